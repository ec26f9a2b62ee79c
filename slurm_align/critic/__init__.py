"""critic"""
