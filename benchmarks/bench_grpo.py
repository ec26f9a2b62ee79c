"""GRPO (one component: the actor alone, rule reward) against PPO (actor + critic hetjob) on the
same number of rollouts, side by side in one run.

W1-sized models (4 layers, hidden 256, 4 heads, vocab 512, responses up to 128 tokens), actor 2
ranks (DP=2) on the `local` profile, PPO's critic 1 rank; GRPO draws 32 prompts x 4 samples,
PPO 128 prompts x 1 sample. Step times come from the runs' Zarr traces (the first step, which
builds the engine, is skipped). Last line: grpo_step_s= ppo_step_s= grpo_over_ppo=.

    python benchmarks/bench_grpo.py [--steps 3] [--prompts 32] [--samples-per-prompt 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from rich.console import Console

from slurm_align import REPO_ROOT
from slurm_align.analysis.breakdown import compute_breakdown
from slurm_align.analysis.runs import load_run
from slurm_align.config import load_profile, load_run_config
from slurm_align.slurm.launch import launch_run

W1_SHAPE = ["num_layers=4", "hidden_size=256", "num_attention_heads=4", "vocab_size=512", "max_seq_len=256"]
COMMON = [*(f"model.{x}" for x in W1_SHAPE), "generation.max_new_tokens=128", "generation.prompt_batch_size=4",
          "ppo.train_micro_batch_size=4", "actor.tensor_parallel=1", "actor.pipeline_parallel=1",
          "actor.data_parallel=2", "eval.interval=0"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the first is skipped)")
    ap.add_argument("--prompts", type=int, default=32, help="GRPO prompts per step")
    ap.add_argument("--samples-per-prompt", type=int, default=4, help="GRPO group size")
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temp dir)")
    args = ap.parse_args()
    os.chdir(REPO_ROOT)   # the example configs' data paths are relative to the repo
    console = Console()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    rollouts = args.prompts * args.samples_per_prompt
    runs = {
        "grpo": ("grpo_tiny.yaml", [f"ppo.num_rollout_samples={args.prompts}",
                                    f"rl.n_samples_per_prompt={args.samples_per_prompt}",
                                    "ppo.global_batch_size=null"]),
        "ppo": ("ppo_tiny.yaml", [*(f"critic_model.{x}" for x in W1_SHAPE), f"ppo.num_rollout_samples={rollouts}"]),
    }
    step_s = {}
    for name, (example, overrides) in runs.items():
        run = load_run_config(REPO_ROOT / "examples" / example, [*COMMON, f"ppo.num_steps={args.steps}", *overrides])
        console.print(f"[bold]{name}[/]: {rollouts} rollouts per step, components {', '.join(run.components)}")
        state = launch_run(run, load_profile("local"), out / name).wait(console=console)
        if state != "COMPLETED":
            raise SystemExit(f"{name} ended {state}; logs in {out / name / 'logs'}")
        b = compute_breakdown(load_run(out / name, allow_incomplete=True).spans, name, skip_steps=1)
        step_s[name] = b.mean_step_s
        split = "  ".join(f"{p} {s:.2f}" for p, s in zip(b.phases, b.phase_s.mean(axis=0)))
        console.print(f"{name}: step {b.mean_step_s:.2f} s  ({split})", highlight=False)
    print(f"grpo_step_s={step_s['grpo']:.3f} ppo_step_s={step_s['ppo']:.3f} "
          f"grpo_over_ppo={step_s['grpo'] / step_s['ppo']:.2f}")


if __name__ == "__main__":
    main()
