"""Helpers for the preemption and failure tests on the real local Slurm cluster.

The runs are the tiny PPO hetjob of tests/integration/test_ppo.py with static prompt sharding, so a run
that was stopped, requeued and resumed must end with the very weights of an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from slurm_align.config import load_run_config
from slurm_align.rundir import RunDir
from slurm_align.slurm.preemption import read_events
from slurm_align.store.rollouts import RolloutStore
from slurm_align.store.traces import read_traces

HOLD_ACTOR = Path(__file__).parents[1] / "programs" / "preempt_hold_actor.py"
STEPS = 4
DETERMINISTIC = ("switches.dynamic_prompts=false", f"ppo.num_steps={STEPS}", "ppo.save_interval=1")
"""Static sharding: every start gives each rank the same prompts, so resumed == uninterrupted.
The shared reference run (conftest `ppo_reference`) adds its SFT start: runs compared with it
use `tiny_run(*ppo_reference.overrides)`."""


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_align.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def wait_for(condition, what: str, timeout: float = 300, poll: float = 0.1, job=None):
    """Poll until condition() is truthy (its value is returned); fail early if `job` ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if job is not None and job.state() in ("FAILED", "CANCELLED", "COMPLETED", "STOPPED"):
            value = condition()
            if value:
                return value
            raise AssertionError(f"job {job.job_id} ended {job.state()} while waiting for {what}:\n"
                                 + logs_text(job.run_dir.root))
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def stop_by_usr2_after_the_first_step(run, profile, run_dir: Path) -> None:
    """Start `run` on a local profile with the hold actor (it holds after step 1 until the stop
    request came, so the run cannot finish first), send USR2 to the job script as Slurm's
    --signal=B:USR2 would, and wait for the job to end STOPPED at step 1."""
    from slurm_align.slurm.launch import launch_run
    from slurm_align.slurm.render import Entry

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "test_hold").write_text("stop")
    job = launch_run(run, profile, run_dir, entry=Entry(scripts={"actor": HOLD_ACTOR}))
    log = run_dir / "logs" / "actor" / "rank0.log"
    wait_for(lambda: log.exists() and "holding after step 1 " in log.read_text(), "the first step", job=job)
    os.kill(job.record.pid, signal.SIGUSR2)
    state = job.wait(timeout_s=300)
    assert state == "STOPPED", f"{state}\n{logs_text(run_dir)}"
    assert [e["signal"] for e in events(run_dir, "stop_requested")] == ["USR2"]
    assert (run_dir / "stopped_step").read_text().strip() == "1"
    (run_dir / "test_hold").unlink()


def logs_text(run_dir: Path, chars: int = 3000) -> str:
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-chars:]}"
                     for p in [*sorted((Path(run_dir) / "logs").rglob("*.log")),
                               *sorted(Path(run_dir).glob("logs/job-*"))])


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(RunDir(Path(run_dir))) if e["event"] == kind]


def metrics_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def snapshot(run_dir: Path, upto: int) -> dict:
    """Rollouts and actor spans of the steps up to `upto`: a resume that redid them would
    rewrite them (and the spans' start times would differ)."""
    store = RolloutStore.open(Path(run_dir) / "rollouts.zarr", read_only=True)
    spans = read_traces(Path(run_dir) / "traces.zarr").spans
    mine = spans[(spans["component"] == "actor") & (spans["step"] <= upto)]
    return {"rollouts": {int(s): store.read(int(s)) for s in store.steps if s <= upto},
            "spans": np.sort(mine, order=["rank", "start_ns"])}


def assert_unchanged(before: dict, after: dict) -> None:
    assert before["rollouts"].keys() == after["rollouts"].keys()
    for step, data in before["rollouts"].items():
        for name, values in data.items():
            assert np.array_equal(values, after["rollouts"][step][name]), (step, name)
    assert len(before["spans"]) > 0 and np.array_equal(before["spans"], after["spans"])


def _actor_weights(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(str(checkpoint), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}


def key_bias_positions(run_dir: Path) -> torch.Tensor:
    """Where the key projection's bias sits in linear_qkv.bias (megatron's layout: per query group,
    its query heads, then its key head, then its value head), as a bool mask over the last dim.

    Its gradient is 0 in exact arithmetic (a key bias adds q . b to every score of a query, and
    softmax ignores a shift), so it is float noise, and AdamW divides that noise by its own root
    mean square: those entries take steps of about lr with signs set by the last bits of the
    step. Two runs equal up to float rounding (the critic batches requests as they arrive) end
    up to several 1e-5 apart there, while every weight with a real gradient stays within 1e-6."""
    model = load_run_config(RunDir(Path(run_dir)).config).model
    per_group = model.num_attention_heads // model.query_groups
    layout = torch.tensor(([0] * per_group + [1] + [2]) * model.query_groups)   # 0 query, 1 key, 2 value (heads)
    return layout.repeat_interleave(model.head_dim) == 1


def assert_same_final_actor_checkpoint(run_dir: Path, reference: Path, tmp: Path, tol: float = 1e-5) -> str:
    """The run's newest actor checkpoint (weights and AdamW state) equals the reference's of the
    same step within tol, but for the key bias's entries (key_bias_positions: noise that AdamW
    scales up); returns its name."""
    last = sorted(p.name for p in (run_dir / "checkpoints" / "actor").glob("iter_*")
                  if (p / "manifest.json").is_file())[-1]
    a = _actor_weights(run_dir / "checkpoints" / "actor" / last, tmp / "run.pt")
    b = _actor_weights(reference / "checkpoints" / "actor" / last, tmp / "ref.pt")
    assert a.keys() == b.keys() and any(k.startswith("optimizer") for k in a)
    key_bias = key_bias_positions(reference)
    for k in a:
        x, y = a[k].float(), b[k].float()
        if k.endswith("linear_qkv.bias") and x.shape[-1] == key_bias.numel():
            x, y = x[..., ~key_bias], y[..., ~key_bias]
        assert torch.allclose(x, y, rtol=0, atol=tol), (k, float((x - y).abs().max()))
    return last


def assert_trains_every_step(run_dir: Path) -> None:
    """Every training step's actor gradient was nonzero: its weights and AdamW moments moved, so
    a run that lost or skipped a step's update (or a resume that did not load them) ends
    elsewhere. (A policy whose responses never end has a zero gradient at every step.)"""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    norms = {m["step"]: m["train_optim/grad_norm"] for m in rows if "timers/step" in m}
    assert norms and all(n > 0 for n in norms.values()), f"{run_dir}: actor grad norm per step {norms}"


def assert_same_final_state(run_dir: Path, reference: Path, tmp: Path, tol: float = 1e-5) -> None:
    """The run's rollouts and metrics steps match the reference's, each step once; its final actor
    checkpoint (weights and AdamW state) and critic weights equal the reference's within tol. The
    reference must have trained at every step (else equal weights prove nothing)."""
    run_dir, reference = Path(run_dir), Path(reference)
    assert_trains_every_step(reference)
    mine = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True)
    ref = RolloutStore.open(reference / "rollouts.zarr", read_only=True)
    assert mine.steps.tolist() == ref.steps.tolist()            # every step exactly once
    assert metrics_steps(run_dir) == metrics_steps(reference)   # metrics continuous, no duplicates
    for step in ref.steps.tolist():
        a, b = mine.read(int(step)), ref.read(int(step))
        assert np.array_equal(a["response_tokens"], b["response_tokens"]), step
    last = assert_same_final_actor_checkpoint(run_dir, reference, tmp, tol)
    ca = torch.load(run_dir / "checkpoints" / "critic" / f"{last}.pt", weights_only=True)
    cb = torch.load(reference / "checkpoints" / "critic" / f"{last}.pt", weights_only=True)
    assert ca.keys() == cb.keys()
    for k in ca:
        assert torch.allclose(ca[k].float(), cb[k].float(), rtol=0, atol=tol), k
