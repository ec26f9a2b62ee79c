"""Jinja2 templates of the job scripts, installed as package data: slurm_align.sbatch_templates
(a symlink in slurm_align/; slurm_align/resources.py)."""
