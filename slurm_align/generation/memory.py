"""Memory switches around generation: optimizer state and gradients to host while generating,
the engine freed (or asleep) while training.

On a GPU the device copies are released (host buffers are pinned and allocated once); on CPU
everything already lives in host memory, so offload only drops gradients (kept in the host
buffers) and moves nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class TrainingStateOffload:
    """Moves an optimizer's state tensors and the model's gradients to host memory and back."""

    def __init__(self, optimizer: torch.optim.Optimizer, chunks: list):
        self.optimizer = optimizer
        # the optimizer's parameters: a LoRA model's adapters, every parameter otherwise
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self._devices: dict[int, torch.device] = {}
        self._grads: dict[int, torch.Tensor] = {}
        self.offloaded = False
        self.bytes_moved = 0

    @staticmethod
    def _to_host(t: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
        if buf is None or buf.shape != t.shape:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
        buf.copy_(t, non_blocking=True)
        return buf

    @torch.no_grad()
    def offload(self) -> None:
        if self.offloaded:
            return
        moved = 0
        for p in self.params:
            for k, v in self.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                    self.optimizer.state[p][k] = host = self._to_host(v, None)
                    self._devices[id(host)] = v.device
                    moved += v.numel() * v.element_size()
            for attr in ("main_grad", "grad"):
                g = getattr(p, attr, None)
                if isinstance(g, torch.Tensor):
                    self._grads[id(p), attr] = (self._to_host(g, None), g.device)
                    moved += g.numel() * g.element_size() if g.device.type != "cpu" else 0
                    setattr(p, attr, None)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            # The device copies are released only to torch's caching allocator until this: a
            # generation engine in other processes (TensorRT-LLM's workers) sees the memory free
            # only once it is returned to the driver.
            torch.cuda.empty_cache()
        self.bytes_moved, self.offloaded = moved, True

    @torch.no_grad()
    def reload(self) -> None:
        if not self.offloaded:
            return
        for p in self.params:
            for k, v in self.optimizer.state.get(p, {}).items():
                dev = self._devices.get(id(v))
                if isinstance(v, torch.Tensor) and dev is not None:
                    self.optimizer.state[p][k] = v.to(dev, non_blocking=True)
            for attr in ("main_grad", "grad"):
                saved = self._grads.pop((id(p), attr), None)
                if saved is not None:
                    host, dev = saved
                    setattr(p, attr, host.to(dev, non_blocking=True) if dev.type != "cpu" else host)
        self._devices.clear()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.offloaded = False


@contextlib.contextmanager
def generation_phase(engine, offload: TrainingStateOffload | None, *, free_engine_after: bool = True) -> Iterator[None]:
    """Training state on host while generating; afterwards, before the training state comes
    back, the engine's memory is released: free() (the next refit rebuilds it), or, with
    free_engine_after=False, sleep() where the engine has one (TensorRT-LLM: weights and KV
    cache released, woken by the next refit) so that its memory never coexists with training's."""
    if offload is not None:
        offload.offload()
    try:
        yield
    finally:
        if free_engine_after:
            engine.free()
        elif callable(getattr(engine, "sleep", None)):
            engine.sleep()
        if offload is not None:
            offload.reload()
