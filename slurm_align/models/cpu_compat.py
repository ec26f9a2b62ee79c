"""megatron-core 0.16.1 on CPU: every CUDA assumption we work around, in one place.

Applied only when CUDA is absent (`apply_cpu_compat()` is a no-op on a GPU machine) and
idempotent. Nothing in torch itself is patched: each affected megatron module gets its module
global `torch` replaced by a thin proxy that forwards everything to torch except the few CUDA
calls it makes (see ../shared/STACK.md):

- `utils.GlobalMemoryBuffer.get_tensor` allocates on `torch.cuda.current_device()`;
- pipeline `schedules` create `torch.zeros(..., device="cuda")`; `p2p_communication` uses
  `torch.cuda.current_device()` and `torch.cuda.synchronize()`;
- `tensor_parallel.mappings` allocates gather buffers on `torch.cuda.current_device()`;
- `transformer.utils.get_default_causal_mask` builds its mask with `device="cuda"`;
- `RotaryEmbedding.get_emb` moves its frequencies to `torch.cuda.current_device()`;
- the dist-checkpoint save path calls `torch.cuda.synchronize()` / `current_device()`.

The RNG tracker (megatron's `model_parallel_cuda_manual_seed` asserts CUDA) is seeded through
`seed_model_parallel`, which picks megatron's own function on GPU and the CPU path here.
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass, field

import torch
from megatron.core import tensor_parallel

# megatron modules whose CUDA calls are redirected (all are on the CPU training/checkpoint path).
PATCHED_MODULES = (
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
)


class _CpuCuda:
    """Stands in for `torch.cuda` inside patched modules: the 'current device' is the CPU."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def synchronize(device=None):
        return None

    @staticmethod
    def is_available():
        return False


def _cpu_device(device):
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        return torch.device("cpu")
    return device


class _CpuTorch(types.ModuleType):
    """Stands in for `torch` inside patched modules; only tensor factories and torch.cuda differ."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device=_cpu_device(device), **kwargs)

    @staticmethod
    def empty(*args, device=None, **kwargs):
        return torch.empty(*args, device=_cpu_device(device), **kwargs)

    @staticmethod
    def ones(*args, device=None, **kwargs):
        return torch.ones(*args, device=_cpu_device(device), **kwargs)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, device=_cpu_device(device), **kwargs)


@dataclass
class CompatState:
    """What apply_cpu_compat did (kept on the function so tests can inspect it)."""

    applied: bool = False
    patched: list[str] = field(default_factory=list)


_STATE = CompatState()  # idempotence record; the only module-level state, by necessity


def cuda_present() -> bool:
    return torch.cuda.is_available()


def apply_cpu_compat(force: bool = False) -> CompatState:
    """Redirect megatron-core's CUDA calls to the CPU. Does nothing when CUDA is available
    (unless `force`, for tests of the patching itself). Safe to call any number of times."""
    if _STATE.applied or (cuda_present() and not force):
        return _STATE
    proxy = _CpuTorch()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = proxy
            _STATE.patched.append(name)
    _STATE.applied = True
    return _STATE


def is_applied() -> bool:
    return _STATE.applied


def seed_model_parallel(seed: int) -> None:
    """Seed torch and megatron's tensor-parallel RNG tracker (CPU or GPU)."""
    torch.manual_seed(seed)
    if cuda_present():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        # model_parallel_cuda_manual_seed asserts CUDA; the inference tracker needs no CUDA state
        # and dropout is 0 in every model here, so nothing draws from it.
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
