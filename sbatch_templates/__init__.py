"""Jinja2 templates of the job scripts, installed as package data: slurm_align.sbatch_templates
(setup.py, slurm_align/resources.py)."""
