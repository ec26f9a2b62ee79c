"""megatron-core 0.16.1 on CPU: every CUDA assumption we work around, in one place.

Applied only when CUDA is absent (`apply_cpu_compat()` is a no-op on a GPU machine) and
idempotent. Nothing in torch itself is patched: each affected megatron module gets its module
global `torch` replaced by a thin proxy that forwards everything to torch except the few CUDA
calls it makes (see ../shared/STACK.md):

- `utils.GlobalMemoryBuffer.get_tensor` allocates on `torch.cuda.current_device()`;
- pipeline `schedules` create `torch.zeros(..., device="cuda")`; `p2p_communication` uses
  `torch.cuda.current_device()` and `torch.cuda.synchronize()`;
- `tensor_parallel.mappings` allocates gather buffers on `torch.cuda.current_device()`, and its
  all-to-all gets split sizes as tensors on CPU (passed on as lists);
- `transformer.utils.get_default_causal_mask` builds its mask with `device="cuda"`;
- `RotaryEmbedding.get_emb` moves its frequencies to `torch.cuda.current_device()`;
- the dist-checkpoint save path calls `torch.cuda.synchronize()` / `current_device()`;
- activation recompute saves and restores the CUDA generator's state (`tensor_parallel.random`'s
  `_get_cuda_rng_state` / `_set_cuda_rng_state`: no-ops here, the CPU generator is saved beside);
- MoE: the all-to-all token dispatcher makes a `torch.cuda.Stream()` for its device-to-host
  copies (one shared no-op stream here: CPU work is ordered), the router, experts and the aux
  loss tracker allocate on `current_device()` / `device="cuda"`;
- fp16's loss scaler (`optimizer.grad_scaler.DynamicGradScaler`) makes its tensors on "cuda".

The RNG tracker (megatron's `model_parallel_cuda_manual_seed` asserts CUDA) is seeded through
`seed_model_parallel`, which picks megatron's own function on GPU and the CPU path here.
"""

from __future__ import annotations

import contextlib
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
    # MoE: the all-to-all dispatcher's device-to-host side stream, router/expert buffers
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    # fp16: DynamicGradScaler keeps its scale on device="cuda"
    "megatron.core.optimizer.grad_scaler",
)


class _NoStream:
    """A CUDA stream's stand-in: CPU work is already ordered, so waiting is a no-op."""

    def wait_stream(self, other) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self) -> _NoStream:
        return self  # an event whose synchronize() has nothing to wait for


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

    _stream = _NoStream()

    @staticmethod
    def Stream(*args, **kwargs):  # capitalised: torch.cuda's name
        return _CpuCuda._stream

    @staticmethod
    def current_stream(device=None):
        return _CpuCuda._stream

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()


def _cpu_device(device):
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        return torch.device("cpu")
    return device


class _CpuDistributed:
    """Stands in for `torch.distributed` in patched modules: all_to_all_single takes its split
    sizes as lists. The MoE dispatcher moves them to host as numpy arrays only from a CUDA
    tensor (`maybe_move_tensor_to_cpu`), so on CPU they arrive as tensors, which gloo refuses."""

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        def as_list(sizes):
            return None if sizes is None else [int(n) for n in sizes]
        return torch.distributed.all_to_all_single(output, input, as_list(output_split_sizes),
                                                   as_list(input_split_sizes), **kwargs)


class _CpuTorch(types.ModuleType):
    """Stands in for `torch` inside patched modules; only tensor factories, torch.cuda and
    torch.distributed.all_to_all_single differ."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        self.distributed = _CpuDistributed()

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
    def tensor(data, device=None, **kwargs):   # torch.tensor: data, then keywords only
        return torch.tensor(data, device=_cpu_device(device), **kwargs)


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
    _define_missing_te_names()
    if _STATE.applied or (cuda_present() and not force):
        return _STATE
    proxy = _CpuTorch()
    _cpu_recompute()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = proxy  # type: ignore[attr-defined]  # the getattr above: it has one
            _STATE.patched.append(name)
    _STATE.applied = True
    return _STATE


def _cpu_recompute() -> None:
    """Activation recompute (tensor_parallel.random's CheckpointFunction) saves and restores the
    CUDA generator's state around the recomputed forward. Without CUDA there is none: the CPU
    generator's state (which it also saves) and the RNG tracker's are all there is."""
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *args, **kwargs: None  # type: ignore[assignment]  # no CUDA generator
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None  # type: ignore[assignment]  # no CUDA generator


def _define_missing_te_names() -> None:
    """megatron-core 0.16.1's MoE router GEMM tests `te_general_gemm is not None`, a name only
    bound when Transformer Engine imports (NameError without it, CPU or GPU): bind it to None,
    the value its own check expects for 'no TE'."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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
