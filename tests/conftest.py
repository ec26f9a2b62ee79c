"""Shared pytest set-up: session environment, marker logic, the xdist workers' groups, the real
Slurm cluster and the end-to-end runs several test files share.

The suite runs on three pytest-xdist workers (`-n 3 --dist loadgroup`, setup.cfg). A session or
module fixture is built once PER WORKER, so:
- the tests of one file that use the `slurm_cluster` fixture go to one worker (xdist group
  `slurm-<file>`); each worker that runs such a group starts its own cluster (session fixture),
  so the workers run Slurm test files in parallel, each on its own cluster (own ports, own state);
- tests that share a module- or session-scoped fixture of a test file go to one worker too (their
  group is made here from the fixture's name, see `_xdist_groups`), unless the fixture is listed
  in SHARED_ACROSS_WORKERS: those are built once for the whole session (`build_once`), whichever
  worker asks first, and the other workers wait for them and reuse them.
- a test can name its group itself with `@pytest.mark.xdist_group("name")`.

Add fixtures of your own area in their own section below (keep one section per area).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cluster import ClusterError, LocalSlurmCluster, slurm_installed

SLURM_GROUP = "slurm"
"""Prefix of the xdist groups of the tests that use the real Slurm cluster: one group per test file
(`slurm-test_preempt`), so the files' mostly waiting jobs run side by side on the workers, each
worker on its own cluster (tests/cluster picks a free port block per cluster under PORT_LOCK)."""
SHARED_ACROSS_WORKERS = {"slurm_cluster", "sft_checkpoint", "rm_checkpoint", "ppo_reference", "grpo_learning_run"}
"""Session fixtures that never pull their users into one group: `slurm_cluster` has its own
group, the others are built once per session for all workers (`build_once`)."""

# --- session environment ------------------------------------------------------
# MPI as root, one thread per process (2 cores shared by every rank of every test).
SESSION_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMP_NUM_THREADS": "1",
    # megatron.core wraps its fused kernels in torch.compile at import, which loads TorchDynamo:
    # ~2 s of CPU in every rank of every run (hundreds of processes a session). CPU tests never
    # compile (eager math is what they compare with transformers), so skip dynamo in them.
    "TORCHDYNAMO_DISABLE": "1",
}


def pytest_configure(config: pytest.Config) -> None:
    os.environ.update(SESSION_ENV)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    """Collection imports the test modules (torch, megatron-core, transformers, peft, ...) without
    the garbage collector, then freezes what they made, as every rank's imports are."""
    from slurm_align.launchers import importing

    with importing():
        return (yield)


# --- markers ------------------------------------------------------------------
def _cuda_available() -> bool:
    import torch  # only imported when a gpu test was collected

    return torch.cuda.is_available()


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook reads the xdist_group markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test that uses the cluster is a `slurm` test, so `-m "not slurm"` deselects it.
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)
    _xdist_groups(items, loadgroup=bool(getattr(config.option, "loadgroup", False)))   # set on xdist workers
    _long_tests_first(items)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU: torch.cuda.is_available() is False")
        for item in gpu_items:
            item.add_marker(skip)


# --- CPU accounting (opt-in) ---------------------------------------------------------
# SLURM_ALIGN_CPU_REPORT=FILE appends one JSON line per test phase: the CPU seconds (user + sys)
# this pytest process and every child it waited for (mpirun and its ranks, local jobs, CLI calls)
# spent in it. Unlike wall time it hardly changes with the load beside the run, so it is what
# tells which tests cost a slow 2-core host most (Slurm jobs run under slurmd: sacct's TotalCPU).
def _cpu_seconds() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    report = os.environ.get("SLURM_ALIGN_CPU_REPORT")
    if not report:
        yield
        return
    import json
    import time

    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    line = json.dumps({"test": item.nodeid, "cpu_s": round(_cpu_seconds() - cpu, 2),
                       "wall_s": round(time.monotonic() - wall, 2)})
    with open(report, "a") as f:   # one short line per write: O_APPEND keeps the workers' lines whole
        f.write(line + "\n")


# --- xdist groups ------------------------------------------------------------------
def _shared_fixtures(item: pytest.Item) -> set[str]:
    """Keys of the module/session fixtures of test files (not pytest's own) that `item` uses."""
    keys = set()
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in (info.name2fixturedefs.items() if info else ()):
        d = defs[-1]
        if d.scope == "function" or name in SHARED_ACROSS_WORKERS:
            continue
        where = getattr(d.func, "__module__", "") or ""
        if where.startswith("tests"):
            keys.add(f"{where}.{name}")
    return keys


def _xdist_groups(items: list[pytest.Item], loadgroup: bool = False) -> None:
    """Give every test at most one xdist_group: tests joined by a shared expensive fixture (or by
    an explicit xdist_group marker, or by the cluster) end in the same group. (xdist joins several
    markers' names into a new group, which would split users of one fixture: hence one marker.)"""
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent.setdefault(k, k) != k:
            k = parent[k]
        return k

    keys_of: dict[str, list[str]] = {}
    for item in items:
        keys = [f"group:{m.args[0] if m.args else m.kwargs.get('name', 'default')}"
                for m in item.iter_markers("xdist_group")]
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            keys.append(f"group:{SLURM_GROUP}-{item.path.stem}")
        keys += sorted(_shared_fixtures(item))
        for k in keys:
            find(k)
        for k in keys[1:]:
            parent[find(k)] = find(keys[0])
        keys_of[item.nodeid] = keys
    names: dict[str, str] = {}   # root -> group name: an explicit name where the set has one
    for k in sorted(parent):
        root = find(k)
        if k.startswith("group:") and not names.get(root, "").startswith("group:"):
            names[root] = k
        names.setdefault(root, k)
    for item in items:
        keys = keys_of[item.nodeid]
        if keys:
            name = names[find(keys[0])].removeprefix("group:")
            for mark in list(item.own_markers):
                if mark.name == "xdist_group":
                    item.own_markers.remove(mark)
            item.add_marker(pytest.mark.xdist_group(name))
            if loadgroup:
                _suffix_group(item, name)


def _long_tests_first(items: list[pytest.Item]) -> None:
    """xdist hands out the groups first (those of most tests first), then the groups of one test
    and the single tests in collection order: put the long single tests (marked slow) and the
    Slurm files' tests at the head of those, so that none starts last and runs alone while the
    other workers idle (measured: 20-30% of the CPU idle in a run's last minute), and the Slurm
    jobs' waits (time limits, requeues) overlap the other workers' computing. A stable sort:
    every other test keeps its place, and the tests of a group their order."""
    def early(item: pytest.Item) -> bool:
        group = item.get_closest_marker("xdist_group")
        if group is None:
            return bool(item.get_closest_marker("slow"))
        return str(group.args[0]).startswith(f"{SLURM_GROUP}-")
    items.sort(key=lambda item: not early(item))


def _suffix_group(item: pytest.Item, name: str) -> None:
    """What xdist's worker does for --dist loadgroup (nodeid 'ID@group', which its scheduler
    groups by), done here because xdist 3.8 sets `item._nodeid`, which pytest 9.2 no longer reads
    (Node.nodeid is str(item._id)): without this every group would be split over the workers."""
    if "@" in item.nodeid or not hasattr(item, "_id"):
        return
    from _pytest.nodeid import NodeId  # pytest >= 9.2 (where _id exists)
    item._id = NodeId.parse(f"{item.nodeid}@{name}")
    assert item.nodeid.endswith(f"@{name}"), item.nodeid


@pytest.fixture(autouse=True)
def _cpu_ranks_for_cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks a CPU test starts stay on CPU on a GPU machine too (CUDA hidden from its child
    processes): these tests are about gloo ranks, and two of them on one GPU is refused (NCCL)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


# --- the real Slurm test cluster (tests/cluster) -------------------------------
@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[LocalSlurmCluster]:
    """munged + slurmctld + 4 slurmd (n1..n4, partition `debug`) on this host, for the session.

    Sets SLURM_CONF in os.environ, so sbatch/srun/squeue just work; stopped (jobs cancelled
    first, daemons by PID) at session end, even when tests fail; its logs are kept then.
    """
    if not slurm_installed():
        reason = "Slurm is not installed (slurmctld/slurmd/sinfo): run bash .ci/setup.sh"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI must run the real-cluster tests)", pytrace=False)
        pytest.skip(reason)
    workdir = Path(tempfile.mkdtemp(prefix="sa-cluster-", dir="/tmp"))
    cluster = LocalSlurmCluster(workdir, n_nodes=4, cpus_per_node=2)
    try:
        cluster.start()
    except ClusterError as exc:
        pytest.fail(f"the local Slurm cluster did not start:\n{exc}", pytrace=False)
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    try:
        yield cluster
    finally:
        cluster.stop()
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        if request.session.testsfailed:
            print(f"\n[slurm_cluster] tests failed: daemon logs kept in {cluster.log_dir}")
        else:
            cluster.remove()


# --- end-to-end runs shared by several test files ---------------------------------
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder common to both xdist workers of this session (the workers' base temp dirs are
    siblings under it), or this session's base temp dir when xdist is off."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(folder)` run once per session for every worker: the first caller builds under a file
    lock, later callers (this worker or the other) wait on the lock and get the finished folder.
    A build that raised leaves no folder, so the next caller tries again (and fails the same way)."""
    root = shared_dir(tmp_path_factory) / "shared-runs"
    root.mkdir(exist_ok=True)
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes, even on error
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            try:
                build(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            done.touch()
    return folder


def _launch_and_wait(run, run_dir: Path, what: str, timeout_s: float = 900) -> None:
    from slurm_align.config import load_profile
    from slurm_align.slurm.launch import launch_run

    job = launch_run(run, load_profile("local"), run_dir)
    state = job.wait(timeout_s=timeout_s)
    if state != "COMPLETED":
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for ps in job.failed_logs().values() for p in ps)
        pytest.fail(f"{what} ended {state}\n{logs}")


SFT_STEPS = 50


@pytest.fixture(scope="session")
def sft_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weak SFT policy (examples/sft_tiny.yaml, SFT_STEPS steps on the synthetic sort task): it
    sorts some held-out prompts exactly (greedy) and leaves room to learn. Built once per session
    for all workers; pass it as `model.init_checkpoint=<it>`. Read-only: never train into it."""
    from slurm_align import REPO_ROOT
    from slurm_align.config import load_run_config

    synth = REPO_ROOT / "examples" / "synthetic"

    def build(folder: Path) -> None:
        run = load_run_config(REPO_ROOT / "examples" / "sft_tiny.yaml", [
            f"data.train_path={synth / 'sft_train.jsonl'}", f"data.val_path={synth / 'sft_val.jsonl'}",
            "trainer.save_interval=0", f"trainer.num_steps={SFT_STEPS}"])
        _launch_and_wait(run, folder / "run", "the shared SFT run")
    return build_once(tmp_path_factory, "sft", build) / "run" / "checkpoints" / "sft"


@pytest.fixture(scope="session")
def rm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reward model trained on the synthetic preference pairs (examples/rm_tiny.yaml). Built once
    per session for all workers; pass it as `critic_model.init_checkpoint=<it>` (PPO's critic
    starts from it) or as the reward model. Read-only."""
    from slurm_align import REPO_ROOT
    from slurm_align.config import load_run_config

    synth = REPO_ROOT / "examples" / "synthetic"

    def build(folder: Path) -> None:
        run = load_run_config(REPO_ROOT / "examples" / "rm_tiny.yaml", [
            f"data.train_path={synth / 'pref_train.jsonl'}", f"data.val_path={synth / 'pref_val.jsonl'}",
            "trainer.save_interval=0"])
        _launch_and_wait(run, folder / "run", "the shared reward-model run")
    return build_once(tmp_path_factory, "rm", build) / "run" / "checkpoints" / "rm"


@pytest.fixture(scope="session")
def grpo_learning_run(tmp_path_factory: pytest.TempPathFactory, sft_checkpoint: Path) -> Path:
    """grpo_tiny's learning run from the shared SFT policy (tests/integration/test_grpo.py `learning_config`):
    GRPO's own learning test and the asynchronous example's comparison with it read the same run.
    Built once per session for all workers; its run directory. Read-only."""
    from tests.integration.test_grpo import launch_learning, learning_config

    def build(folder: Path) -> None:
        launch_learning(folder / "run", learning_config(sft_checkpoint, "algorithm=grpo"))   # one actor rank
    return build_once(tmp_path_factory, "grpo-learning", build) / "run"


class PpoReference:
    """The shared reference PPO run (fixture `ppo_reference`): `overrides` is its config on top of
    tests/integration/test_ppo.py `tiny_run` (a run that must end as it does starts with `tiny_run(*overrides)`),
    and calling it waits for the run and returns its run directory."""

    def __init__(self, overrides: tuple[str, ...], wait: Callable[[], Path]):
        self.overrides, self._wait = overrides, wait

    def __call__(self) -> Path:
        return self._wait()


@pytest.fixture(scope="session")
def ppo_reference(tmp_path_factory: pytest.TempPathFactory, sft_checkpoint: Path) -> PpoReference:
    """The uninterrupted tiny PPO run with static prompts (tests/integration/test_ppo.py `tiny_run` with
    tests/support/preempt_support.py DETERMINISTIC: 4 steps, a checkpoint after each, on the local
    profile), its actor from the session's SFT policy: its responses end, so every step trains
    (from a random init none ends, the gradient is 0 and a resume that never loaded the
    checkpoint's weights or optimizer state would end the same). Every run of that config that
    was stopped, killed, requeued or resumed must end with its rollouts and final weights
    (preempt_support.assert_same_final_state).

    Started in the background when a test first asks for the fixture (once the SFT policy is
    there); the fixture's value (a PpoReference) gives the overrides, and waits for the run when
    called. Built once per session for all workers (the other workers' calls wait for it)."""
    from slurm_align.config import load_profile
    from slurm_align.slurm.launch import launch_run
    from tests.integration.test_ppo import tiny_run
    from tests.support.preempt_support import DETERMINISTIC, logs_text

    overrides = (*DETERMINISTIC, f"model.init_checkpoint={sft_checkpoint}")

    def build(folder: Path) -> None:
        job = launch_run(tiny_run(*overrides), load_profile("local"), folder / "run")
        state = job.wait(timeout_s=900)
        if state != "COMPLETED":
            raise AssertionError(f"the reference PPO run ended {state}\n{logs_text(folder / 'run')}")

    result: dict = {}

    def target() -> None:
        try:
            result["dir"] = build_once(tmp_path_factory, "ppo-reference", build) / "run"
        except BaseException as exc:   # re-raised in the test that waits
            result["error"] = exc

    thread = threading.Thread(target=target, name="ppo-reference", daemon=True)
    thread.start()

    def wait() -> Path:
        thread.join(timeout=1200)
        if "error" in result:
            raise result["error"]
        assert "dir" in result, "the reference PPO run did not end within 1200 s"
        return result["dir"]
    return PpoReference(overrides, wait)


# --- model-parallel layout runs (tests/support/layout_runs.py) -----------------------
@pytest.fixture(scope="session")
def layout_runs(tmp_path_factory: pytest.TempPathFactory):
    """TP=2 / PP=2 checks, checkpoint saves and TP=1 loads in four mpirun launches, read by
    test_models_parallel and test_checkpoint (their users share one worker: one build). Read-only."""
    from tests.support.layout_runs import run_layouts

    return run_layouts(tmp_path_factory.mktemp("layouts"))
