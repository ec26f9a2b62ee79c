"""Files shipped with the package: sbatch templates, launchers, cluster profiles.

In a checkout they live in the top-level folders sbatch_templates/, launchers/ and
cluster_profiles/ (the charter's layout). A symlink in slurm_align/ puts each folder in the package
(slurm_align.sbatch_templates, slurm_align.launchers, slurm_align.cluster_profiles), so a wheel
carries them and an editable install finds them where they are; the library reaches them only
through importlib.resources, never through the checkout's path. Launchers run by module name
(`python -m slurm_align.launchers.actor`), so a job needs the installed package, not the source tree.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

TEMPLATES = "slurm_align.sbatch_templates"
LAUNCHERS = "slurm_align.launchers"
PROFILES = "slurm_align.cluster_profiles"


def folder(package: str) -> Path:
    """The folder of a shipped-data package on disk (installs from a wheel or editable; a zipped
    install is not supported: Jinja2 and the profile search read plain files)."""
    return Path(str(resources.files(package)))


def launcher_module(name: str) -> str:
    """`python -m` name of launchers/<name>.py."""
    return f"{LAUNCHERS}.{name}"


def launcher_names() -> list[str]:
    return sorted(p.stem for p in folder(LAUNCHERS).glob("*.py") if p.stem != "__init__")
