"""Shipped cluster profiles (YAML), installed as package data: slurm_align.cluster_profiles
(setup.py, slurm_align/resources.py)."""
