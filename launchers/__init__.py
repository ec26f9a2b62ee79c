"""Entry modules that each rank of a job component runs: `python -m slurm_align.launchers.<name>`.

This folder is installed as the package slurm_align.launchers (a symlink in slurm_align/; slurm_align/resources.py)."""
