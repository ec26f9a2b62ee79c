"""Typed configuration: run configs and cluster profiles (pydantic v2, YAML, dotted overrides)."""

from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import (
    apply_overrides,
    check_against_profile,
    load_profile,
    load_run_config,
    read_yaml,
)
from slurm_align.config.profile import ClusterProfile, ComponentResources
from slurm_align.config.run import (
    GenerationConfig,
    ModelConfig,
    ParallelConfig,
    PPOConfig,
    RunConfig,
    Switches,
    TrainerConfig,
)

__all__ = [
    "ClusterProfile",
    "ComponentResources",
    "ConfigError",
    "GenerationConfig",
    "ModelConfig",
    "PPOConfig",
    "ParallelConfig",
    "RunConfig",
    "Switches",
    "TrainerConfig",
    "apply_overrides",
    "check_against_profile",
    "load_profile",
    "load_run_config",
    "read_yaml",
]
