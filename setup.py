"""Packages only; all other metadata lives in setup.cfg.

The charter fixes the top-level folders launchers/, sbatch_templates/ and cluster_profiles/;
they are mapped into the package here (a setup.cfg `packages = find:` cannot add mapped
packages), so `pip install .` ships them and an editable install finds them in the checkout.
"""

from setuptools import find_packages, setup

SHIPPED = {
    "slurm_align.launchers": "launchers",
    "slurm_align.sbatch_templates": "sbatch_templates",
    "slurm_align.cluster_profiles": "cluster_profiles",
}

setup(
    packages=find_packages(include=["slurm_align", "slurm_align.*"]) + list(SHIPPED),
    package_dir=SHIPPED,
)
