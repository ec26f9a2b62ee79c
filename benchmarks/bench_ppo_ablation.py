"""PPO ablation: one step with every optimisation on, each one off, and all off (naive).

Runs real PPO jobs on the `local` profile (actor 2 ranks as TP1 x PP2 so the refold matters,
critic 1 rank) with W1-sized models (4 layers, hidden 256, 4 heads, vocab 512, responses up to
128 tokens), side by side in one run, and reads step times back from the runs' Zarr traces
(the first step, which builds the engine, is skipped). Prints a table with the per-phase split;
the last line holds key=value figures, including naive_over_full=.

    python benchmarks/bench_ppo_ablation.py [--steps 2] [--samples 32] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from slurm_align import REPO_ROOT
from slurm_align.analysis.breakdown import compute_breakdown
from slurm_align.analysis.runs import load_run
from slurm_align.config import load_profile, load_run_config
from slurm_align.slurm.launch import Job, JobRecord, launch_run

SWITCHES = ("kv_cache_engine", "dynamic_prompts", "async_critic", "refold", "offload_optimizer")
W1_SHAPE = ["num_layers=4", "hidden_size=256", "num_attention_heads=4", "vocab_size=512", "max_seq_len=256"]
W1 = [*(f"model.{x}" for x in W1_SHAPE), *(f"critic_model.{x}" for x in W1_SHAPE), "generation.max_new_tokens=128",
      "actor.tensor_parallel=1", "actor.pipeline_parallel=2", "actor.data_parallel=1", "generation.prompt_batch_size=4",
      "ppo.train_micro_batch_size=4"]


def variants() -> dict[str, list[str]]:
    out = {"full": []}
    for s in SWITCHES:
        out[f"no_{s}"] = [f"switches.{s}=false"]
    out["naive"] = [f"switches.{s}=false" for s in SWITCHES]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="PPO steps per variant (the first is skipped)")
    ap.add_argument("--samples", type=int, default=32, help="rollout samples per step")
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temp dir)")
    ap.add_argument("--reuse", action="store_true",
                    help="re-analyse variants that already completed under --out instead of rerunning them")
    args = ap.parse_args()
    os.chdir(REPO_ROOT)   # the example config's data path is relative to the repo
    console = Console(width=None if Console().is_terminal else 220)   # logs get the whole table
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-ppo-"))
    profile = load_profile("local")
    base = [*W1, f"ppo.num_steps={args.steps}", f"ppo.num_rollout_samples={args.samples}"]
    results = {}
    for name, overrides in variants().items():
        run = load_run_config(REPO_ROOT / "examples" / "ppo_tiny.yaml", [*base, *overrides])
        console.print(f"[bold]{name}[/]: {' '.join(overrides) or 'all optimisations on'}")
        if args.reuse and (out / name / "job.json").exists():
            state = Job(JobRecord.load(out / name)).state()
        else:
            state = launch_run(run, profile, out / name).wait(console=console)
        if state != "COMPLETED":
            raise SystemExit(f"variant {name} ended {state}; logs in {out / name / 'logs'}")
        traces = load_run(out / name, allow_incomplete=True)
        results[name] = compute_breakdown(traces.spans, name, skip_steps=1)

    phases = sorted({p for b in results.values() for p in b.phases}, key=lambda p: results["full"].phases.index(p)
                    if p in results["full"].phases else 99)
    table = Table(title=f"PPO step time (s), W1, {args.samples} samples, mean of steps 1..{args.steps - 1}")
    table.add_column("variant")
    table.add_column("step s", justify="right")
    table.add_column("/ full", justify="right")
    for p in phases:
        table.add_column(p, justify="right")
    full = results["full"].mean_step_s
    for name, b in results.items():
        split = dict(zip(b.phases, b.phase_s.mean(axis=0)))
        table.add_row(name, f"{b.mean_step_s:.2f}", f"{b.mean_step_s / full:.2f}x",
                      *[f"{split.get(p, 0.0):.2f}" for p in phases])
    console.print(table)
    figures = {"full_s": f"{full:.3f}", "naive_s": f"{results['naive'].mean_step_s:.3f}",
               "naive_over_full": f"{results['naive'].mean_step_s / full:.2f}"}
    for s in SWITCHES:
        figures[f"no_{s}_over_full"] = f"{results[f'no_{s}'].mean_step_s / full:.2f}"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
