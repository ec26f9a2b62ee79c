"""Shipped cluster profiles (YAML), installed as package data: slurm_align.cluster_profiles
(a symlink in slurm_align/; slurm_align/resources.py)."""
