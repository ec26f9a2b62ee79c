"""Entry modules that each rank of a job component runs: `python -m slurm_align.launchers.<name>`.

This folder is installed as the package slurm_align.launchers (setup.py, slurm_align/resources.py)."""
