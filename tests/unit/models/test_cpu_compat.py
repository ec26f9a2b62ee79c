"""cpu_compat: applied only without CUDA, idempotent, inert on GPU; HostSwap without re-allocation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

PROBE = r"""
import sys, torch, importlib
if sys.argv[1] == "cuda":
    torch.cuda.is_available = lambda: True   # what a GPU machine reports
from slurm_align.models import cpu_compat
s1 = cpu_compat.apply_cpu_compat()
n1 = list(s1.patched)
s2 = cpu_compat.apply_cpu_compat()
mods = [importlib.import_module(m) for m in cpu_compat.PATCHED_MODULES]
untouched = sum(m.torch is torch for m in mods)
print(f"applied={s2.applied} patched={len(n1)} again={len(s2.patched)} untouched={untouched} total={len(mods)}")
"""


def probe_env() -> dict[str, str]:
    """A clean environment for the probe, keeping PYTHONPATH: where packages were installed beside
    the interpreter's own (run_gpu_checks.sh's .gpu-deps, megatron-core included) it is the only
    way the probe finds them."""
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE, mode], capture_output=True,
                         text=True, timeout=120, env=probe_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(kv.split("=") for kv in out.stdout.strip().splitlines()[-1].split())


def test_cpu_compat_patches_every_module_once_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = probe("cpu")
    assert r["applied"] == "True"
    assert int(r["patched"]) == int(r["total"]) and r["again"] == r["patched"], r  # idempotent
    assert r["untouched"] == "0"


def test_cpu_compat_is_a_no_op_when_cuda_is_reported():
    r = probe("cuda")
    assert r["applied"] == "False" and r["patched"] == "0"
    assert r["untouched"] == r["total"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cpu_compat_inert_on_real_gpu():
    r = probe("real")
    assert r["applied"] == "False" and r["untouched"] == r["total"]


def test_the_probe_finds_packages_installed_on_pythonpath(tmp_path, monkeypatch):
    """The GPU machine's megatron-core lives in a folder on PYTHONPATH (.gpu-deps): a module that
    only PYTHONPATH reaches must import in the probe's environment."""
    (tmp_path / "only_on_pythonpath.py").write_text("WHERE = 'pythonpath'\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(":"))
    out = subprocess.run([sys.executable, "-c", "import only_on_pythonpath; print(only_on_pythonpath.WHERE)"],
                         capture_output=True, text=True, timeout=60, env=probe_env(), cwd=tmp_path.parent)
    assert out.returncode == 0 and out.stdout.strip() == "pythonpath", out.stderr[-2000:]


def test_cpu_proxy_redirects_cuda_device_only():
    from slurm_align.models.cpu_compat import _CpuTorch
    t = _CpuTorch()
    assert t.zeros(3, device="cuda").device.type == "cpu"
    assert t.cuda.current_device() == torch.device("cpu")
    assert t.Tensor is torch.Tensor and t.float32 is torch.float32


def test_host_swap_exchanges_weights_without_reallocating():
    from slurm_align.models.weights import HostSwap
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    ref = [p.detach().clone() for p in model.parameters()]
    swap = HostSwap([model])
    ptrs = [h.data_ptr() for h in swap.host]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # "training" changes the live weights
    trained = [p.detach().clone() for p in model.parameters()]
    swap.swap()  # model now holds the reference weights, host holds trained
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), ref))
    swap.swap()
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained))
    swap.stash()
    swap.offload()
    swap.onload()
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained))
    assert [h.data_ptr() for h in swap.host] == ptrs
