"""Store cost: Zarr rollout appends against raw .npy files of the same bytes, the trace flush, and
the store phase against a real tiny PPO step.

    python benchmarks/bench_store.py [--steps 30] [--run-dir RUNS/ppo] [--ppo-steps 4]

1. Rollout appends, W1-sized (32 samples x 192 response tokens, 64 prompt tokens) and tiny-run
   sized (32 samples x 12 response tokens, 8 prompt tokens): RolloutStore.append_step (fsync on,
   as in runs) against writing the same columns as one .npy file each with the same durability
   (temp file, fsync, os.replace), interleaved step by step. zarr_over_npy = npy time / zarr time
   for the W1 size (>= 0.7 is the target: Zarr at least 70% of raw throughput).
2. Trace flush: one Tracer.step_done with a PPO step's worth of spans (9), per step.
3. store_over_step: the `store` phase over the step time (breakdown definitions: max over ranks),
   means over the steps after the first, read from the traces of a real tiny PPO run: by default
   this script runs examples/ppo_tiny.yaml for --ppo-steps steps on the local profile (from random
   init, a few seconds per step); --run-dir reads an existing run's traces instead (e.g. the
   20 steps of examples/ppo_tiny.sh). store_over_step_p50 is the median over steps of the ratio.
   An append is three fsynced files (the disk's fsync latency, fsync_ms, is measured here too);
   PPO writes its store in the background (RolloutStore(background=True)), so its `store` phase
   is the check and hand-off, and the files are written while the step goes on. The appends of
   part 1 are synchronous: zarr_over_npy compares like with like.
The last line holds the figures as key=value.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from slurm_align.analysis.breakdown import compute_breakdown
from slurm_align.profiling import phases as P
from slurm_align.profiling.timers import Tracer
from slurm_align.store.rollouts import TOKEN_FIELDS, RolloutStore
from slurm_align.store.traces import read_traces

REPO = Path(__file__).resolve().parents[1]
SIZES = {"w1": (32, 64, 192), "tiny": (32, 8, 12)}
"""name -> (samples, prompt tokens, response tokens) per sample."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="appends per size and writer")
    p.add_argument("--run-dir", help="read store/step times from this PPO run instead of running one")
    p.add_argument("--ppo-steps", type=int, default=4, help="steps of the tiny PPO run (first is left out)")
    return p.parse_args()


def batch(rng: np.random.Generator, samples: int, prompt: int, response: int) -> dict:
    lengths = rng.integers(response // 2, response + 1, samples)
    return {
        "prompt_tokens": [rng.integers(0, 32000, prompt) for _ in range(samples)],
        "response_tokens": [rng.integers(0, 32000, k) for k in lengths],
        **{f: [rng.standard_normal(k).astype(np.float32) for k in lengths] for f in TOKEN_FIELDS},
        "reward": rng.standard_normal(samples).astype(np.float32),
        "is_end": rng.random(samples) > 0.2,
        "rank": rng.integers(0, 8, samples),
        "version": rng.integers(0, 4, samples),
    }


def npy_columns(b: dict) -> dict[str, np.ndarray]:
    """The same bytes the store writes: flat tokens, stacked per-token values, per-sample ints, reward."""
    lengths = np.array([len(r) for r in b["response_tokens"]])
    return {
        "prompt_tokens": np.concatenate(b["prompt_tokens"]).astype(np.int32),
        "response_tokens": np.concatenate(b["response_tokens"]).astype(np.int32),
        "token_values": np.stack([np.concatenate(b[f]) for f in TOKEN_FIELDS]),
        "sample_values": np.stack([np.array([len(p) for p in b["prompt_tokens"]]), lengths,
                                   b["rank"], b["is_end"], b["version"]]).astype(np.int32),
        "reward": np.asarray(b["reward"], dtype=np.float32),
    }


def write_npy(folder: Path, step: int, b: dict) -> None:
    for name, arr in npy_columns(b).items():
        path = folder / f"{name}.{step}.npy"
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, arr)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def bench_appends(size: str, steps: int, workdir: Path) -> dict[str, float]:
    rng = np.random.default_rng(0)
    batches = [batch(rng, *SIZES[size]) for _ in range(steps)]
    nbytes = sum(a.nbytes for a in npy_columns(batches[0]).values())
    store = RolloutStore.create(workdir / f"{size}.zarr")
    npy_dir = workdir / f"{size}.npy"
    npy_dir.mkdir()
    t_zarr, t_npy = [], []
    for step, b in enumerate(batches):   # interleaved: both see the same disk and page-cache state
        t0 = time.perf_counter()
        store.append_step(step, b)
        t1 = time.perf_counter()
        write_npy(npy_dir, step, b)
        t2 = time.perf_counter()
        t_zarr.append(t1 - t0)
        t_npy.append(t2 - t1)
    # Medians: robust to the odd slow fsync of a shared disk.
    zarr_s, npy_s = float(np.median(t_zarr)), float(np.median(t_npy))
    print(f"{size}: {nbytes / 1e3:.0f} kB per step; zarr append {1e3 * zarr_s:.2f} ms "
          f"({nbytes / zarr_s / 1e6:.0f} MB/s), npy {1e3 * npy_s:.2f} ms ({nbytes / npy_s / 1e6:.0f} MB/s), "
          f"zarr/npy throughput {npy_s / zarr_s:.2f}")
    return {"zarr_s": zarr_s, "npy_s": npy_s}


def bench_trace_flush(steps: int, workdir: Path) -> float:
    per_step = (P.REFIT, P.GENERATE, P.LOGPROBS, P.INIT_LOGPROBS, P.CRITIC_WAIT, P.REBALANCE, P.STORE,
                P.TRAIN, P.PROMPT_WAIT)
    times = []
    with Tracer(workdir, "actor", 0) as tracer:
        for step in range(steps):
            for phase in per_step:
                with tracer.span(phase, step):
                    pass
            t0 = time.perf_counter()
            tracer.step_done(step)
            times.append(time.perf_counter() - t0)
    flush_s = float(np.median(times))
    print(f"trace flush: {1e3 * flush_s:.2f} ms per step ({len(per_step)} spans)")
    return flush_s


def tiny_ppo_run(workdir: Path, steps: int) -> Path:
    """examples/ppo_tiny.yaml for a few steps on the local profile; returns its run directory."""
    from slurm_align.config import load_profile, load_run_config
    from slurm_align.slurm.launch import launch_run
    os.chdir(REPO)   # the example's data path is relative to the repo
    run = load_run_config(REPO / "examples" / "ppo_tiny.yaml", [f"ppo.num_steps={steps}"])
    job = launch_run(run, load_profile("local"), workdir / "ppo")
    state = job.wait(poll_s=0.5, timeout_s=900)
    if state != "COMPLETED":
        raise SystemExit(f"tiny PPO run {state}: see {workdir / 'ppo' / 'logs'}")
    return workdir / "ppo"


def store_over_step(run_dir: Path) -> tuple[float, float, float]:
    """Mean store phase, mean step time, and the median over steps of store / step."""
    b = compute_breakdown(read_traces(run_dir / "traces.zarr").spans, skip_steps=1)
    per_step = b.phase_s[:, b.phases.index(P.STORE)] if P.STORE in b.phases else np.zeros(len(b.steps))
    store_s = float(per_step.mean())
    p50 = float(np.median(per_step / b.step_s))
    print(f"tiny PPO run {run_dir}: {len(b.steps)} step(s) after the first, step {b.mean_step_s:.3f} s, "
          f"store {1e3 * store_s:.2f} ms (median {1e3 * np.median(per_step):.2f} ms, "
          f"max {1e3 * per_step.max():.2f} ms)")
    return store_s, b.mean_step_s, p50


def fsync_ms(folder: Path, n: int = 20) -> float:
    """Median time of writing 4 kB and fsyncing it here: what one committed file costs on this disk."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        with open(folder / f"probe{i}", "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    args = parse()
    with tempfile.TemporaryDirectory(prefix="bench_store_") as tmp:
        work = Path(tmp)
        w1 = bench_appends("w1", args.steps, work)
        bench_appends("tiny", args.steps, work)
        flush_s = bench_trace_flush(args.steps, work)
        fsync = fsync_ms(work)
        run_dir = Path(args.run_dir) if args.run_dir else tiny_ppo_run(work, args.ppo_steps)
        store_s, step_s, p50 = store_over_step(run_dir)
    print(f"fsync_ms={fsync:.2f} w1_zarr_ms={1e3 * w1['zarr_s']:.2f} w1_npy_ms={1e3 * w1['npy_s']:.2f} "
          f"trace_flush_ms={1e3 * flush_s:.2f} store_ms={1e3 * store_s:.2f} step_s={step_s:.3f} "
          f"store_over_step_p50={p50:.4f} zarr_over_npy={w1['npy_s'] / w1['zarr_s']:.2f} "
          f"store_over_step={store_s / step_s:.4f}")


if __name__ == "__main__":
    main()
