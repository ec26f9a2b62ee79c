"""Colocated vs disaggregated (one-step-off) GRPO on the same 2 ranks, side by side in one run.

The same GRPO workload: W1-sized model (4 layers, hidden 256, 4 heads, vocab 512), responses of
up to 128 new tokens (a fresh model rarely samples EOS early, so lengths are long-tailed below
128), the sort prompts, the exact-sort rule reward; one thread per rank on the `local` profile.

    colocated       actor 2 ranks (DP=2): each generates its share, then both train
    disaggregated   rollout.mode disaggregated, max_off_policy_steps 1: generator 1 rank +
                    actor (trainer) 1 rank; the generator makes step s+1 while the trainer
                    trains on step s, and gets the new weights over the stream after each step

Throughput is rollouts per second of the trainer's step time (metrics timers/step), the first
`--warmup` steps skipped (engine build, pipeline fill). Idle shares come from the Zarr traces:
per rank, 1 - (union of its spans) / (its window over the measured steps); the generator's
weight_sync span (waiting for and applying weights) counts as idle. Last line:

    async_over_sync= weight_sync_s= weight_sync_over_step= max_staleness= gen_idle_share= train_idle_share=

    python benchmarks/bench_async.py [--steps 5] [--warmup 2] [--prompts 16] [--samples-per-prompt 4]
                                     [--weight-transport stream|collective] [--one-rank] [--out DIR]

--one-rank adds a third run, colocated on ONE rank with the other core idle, and every run's
per-rank seconds per step of generate, logprobs and train: what each phase costs alone against
beside a busy neighbour (on a 2-vCPU machine the two slow each other down).

weight_sync_s is the trainer's own time per sync (gather, and the stream's send, or with
'collective' posting the broadcasts); the generator's wait for and apply of the weights is its
weight_sync phase, printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.profiling import phases as P
from slurm_align.slurm.launch import launch_run
from slurm_align.store.traces import read_traces

PHASES = (P.GENERATE, P.LOGPROBS, P.TRAIN)
W1_SHAPE = ["num_layers=4", "hidden_size=256", "num_attention_heads=4", "vocab_size=512", "max_seq_len=256"]
COMMON = [*(f"model.{x}" for x in W1_SHAPE), "generation.max_new_tokens=128", "generation.prompt_batch_size=4",
          "ppo.train_micro_batch_size=4", "eval.interval=0", "ppo.global_batch_size=null"]


def idle_share(spans: np.ndarray, component: str, rank: int, first_step: int, idle_phases=()) -> float:
    """1 - busy / window for one rank over steps >= first_step (busy: the union of its spans)."""
    s = spans[(spans["component"] == component) & (spans["rank"] == rank) & (spans["step"] >= first_step)]
    if not len(s):
        return float("nan")
    window = s["end_ns"].max() - s["start_ns"].min()
    busy_spans = sorted((a, b) for a, b, p in zip(s["start_ns"], s["end_ns"], s["phase"]) if p not in idle_phases)
    busy, end = 0, None
    for a, b in busy_spans:   # union of intervals
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return 1.0 - busy / window if window > 0 else float("nan")


def phase_seconds(spans: np.ndarray, component: str, phase: str, first_step: int, rank: int = 0) -> float:
    """Mean seconds per step that `rank` of `component` spent in `phase`, steps >= first_step."""
    s = spans[(spans["component"] == component) & (spans["rank"] == rank) & (spans["step"] >= first_step)
              & (spans["phase"] == phase)]
    steps = len(set(s["step"].tolist()))
    return float((s["end_ns"] - s["start_ns"]).sum() / 1e9 / steps) if steps else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--samples-per-prompt", type=int, default=4)
    ap.add_argument("--weight-transport", choices=("stream", "collective"), default="stream",
                    help="rollout.weight_transport of the disaggregated run")
    ap.add_argument("--one-rank", action="store_true",
                    help="also run colocated on one rank and print every run's per-rank phase seconds")
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temp dir)")
    args = ap.parse_args()
    os.chdir(REPO_ROOT)   # the example's data paths are relative to the repo
    console = Console()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-async-"))
    rollouts = args.prompts * args.samples_per_prompt
    shape = [f"ppo.num_steps={args.steps}", f"ppo.num_rollout_samples={args.prompts}",
             f"rl.n_samples_per_prompt={args.samples_per_prompt}"]
    runs = {
        "colocated": ("grpo_tiny.yaml", ["actor.data_parallel=2"], []),
        "disaggregated": ("grpo_async_tiny.yaml", ["actor.data_parallel=1", "generator.data_parallel=1",
                                                   "rollout.max_off_policy_steps=1",
                                                   f"rollout.weight_transport={args.weight_transport}"],
                          ["components.actor.tasks_per_node=1", "components.generator.tasks_per_node=1"]),
    }
    if args.one_rank:
        runs["one_rank"] = ("grpo_tiny.yaml", ["actor.data_parallel=1"], ["components.actor.tasks_per_node=1"])
    first = args.warmup + 1
    rate, rows, spans, ranks = {}, {}, {}, {}
    for name, (example, overrides, profile_overrides) in runs.items():
        run = load_run_config(REPO_ROOT / "examples" / example, [*COMMON, *shape, *overrides])
        console.print(f"[bold]{name}[/]: {rollouts} rollouts per step, components {', '.join(run.components)}")
        state = launch_run(run, load_profile("local", profile_overrides), out / name).wait(console=console)
        if state != "COMPLETED":
            raise SystemExit(f"{name} ended {state}; logs in {out / name / 'logs'}")
        rows[name] = [m for m in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines())
                      if "timers/step" in m and m["step"] >= first]
        step_s = float(np.mean([m["timers/step"] for m in rows[name]]))
        rate[name] = rollouts / step_s
        ranks[name] = {c: run.parallel(c).world_size for c in run.components}
        spans[name] = read_traces(out / name / "traces.zarr", ranks[name]).spans
        lengths = [m["train_rollouts/response_lengths"] for m in rows[name]]
        console.print(f"{name}: step {step_s:.2f} s, {rate[name]:.1f} rollouts/s, mean response length "
                      f"{np.mean(lengths):.1f}", highlight=False)
    dis = rows["disaggregated"]
    synced = [m for m in dis if "weight_sync/seconds" in m]
    sync_s = float(np.mean([m["weight_sync/seconds"] for m in synced])) if synced else 0.0
    step_s = float(np.mean([m["timers/step"] for m in dis]))
    staleness = max(m["train_rollouts/max_staleness"] for m in dis)
    gen_idle = idle_share(spans["disaggregated"], "generator", 0, first, idle_phases=(P.WEIGHT_SYNC,))
    train_idle = idle_share(spans["disaggregated"], "actor", 0, first)
    gen_sync = phase_seconds(spans["disaggregated"], "generator", P.WEIGHT_SYNC, first)
    sync_mib = np.mean([m['weight_sync/bytes'] for m in synced]) / 2**20
    console.print(f"weight sync ({args.weight_transport}): {sync_mib:.2f} "
                  f"MiB per step; the generator's weight_sync phase {gen_sync:.3f} s per step", highlight=False)
    if args.one_rank:
        table = Table("run", "component", "rank", *(f"{p} s/step" for p in PHASES), title=f"steps >= {first}")
        for name, comps in ranks.items():
            for comp, n in comps.items():
                for r in range(n):
                    table.add_row(name, comp, str(r), *(f"{phase_seconds(spans[name], comp, p, first, r):.2f}"
                                                        for p in PHASES))
        console.print(table)
    print(f"async_over_sync={rate['disaggregated'] / rate['colocated']:.2f} weight_sync_s={sync_s:.4f} "
          f"weight_sync_over_step={sync_s / step_s:.4f} max_staleness={staleness:.0f} "
          f"gen_idle_share={gen_idle:.2f} train_idle_share={train_idle:.2f}")


if __name__ == "__main__":
    main()
