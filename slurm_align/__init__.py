"""slurm-align: Slurm-native RLHF on megatron-core (see ../shared/DESIGN.md)."""

from pathlib import Path

__version__ = "0.1.0"

# The checkout's root, for tests and benchmarks run from one (examples/, tests/). The library
# never reads through it: templates, launchers and profiles come from slurm_align.resources.
REPO_ROOT = Path(__file__).resolve().parent.parent

from slurm_align import megatron_import as _megatron_import  # noqa: E402

_megatron_import.install()
