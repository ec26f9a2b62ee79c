"""slurm-align: Slurm-native RLHF on megatron-core (see ../shared/DESIGN.md)."""

from pathlib import Path

__version__ = "0.1.0"

# The repo's fixed top-level folders that the library reads at run time
# (templates and profiles). An editable install keeps them beside the package.
REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = REPO_ROOT / "sbatch_templates"
PROFILES_DIR = REPO_ROOT / "cluster_profiles"
LAUNCHERS_DIR = REPO_ROOT / "launchers"
