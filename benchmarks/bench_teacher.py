"""On-policy distillation's step time with the teacher as its own component of the job versus
the teacher's forward on the actor's ranks (switches.colocated_teacher), on equal cores.

    python benchmarks/bench_teacher.py [--steps 6] [--teacher CHECKPOINT]

Both runs: grpo_tiny's student on the synthetic sort prompts (static sharding, so both see the
same samples), the student's only reward the teacher's term (docs/algorithms/distillation.md),
the local profile, two processes in all:
    component   actor 1 rank + teacher 1 rank: the teacher scores each micro-batch while the
                actor goes on (its wait: the step's critic_wait span)
    colocated   actor 2 ranks (data-parallel), each running the teacher's forward itself when a
                micro-batch is finished
The teacher defaults to a short SFT run's policy (built first, a minute); --teacher gives one of
the student's shape. Figures: the median step time (timers/step) over steps 2..N of each run;
teacher_wait_share = the component run's median critic_wait / step. Last line:
    teacher_component_over_colocated=<component step / colocated step> teacher_wait_share=<x>
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.config.loading import apply_overrides, read_yaml, validate
from slurm_align.config.run import RunConfig
from slurm_align.slurm.launch import launch_run

SYNTH = REPO_ROOT / "examples" / "synthetic"


def run_and_wait(run: RunConfig, profile_overrides: list[str], run_dir: Path) -> list[dict]:
    job = launch_run(run, load_profile("local", profile_overrides), run_dir)
    state = job.wait(timeout_s=3600)
    if state != "COMPLETED":
        raise SystemExit(f"{run_dir}: {state}; logs in {run_dir / 'logs'}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def build_teacher(root: Path) -> Path:
    run = load_run_config(REPO_ROOT / "examples" / "sft_tiny.yaml", [
        f"data.train_path={SYNTH / 'sft_train.jsonl'}", f"data.val_path={SYNTH / 'sft_val.jsonl'}",
        "trainer.save_interval=0", "trainer.num_steps=20"])
    run_and_wait(run, [], root / "sft")
    return root / "sft" / "checkpoints" / "sft"


def distill(teacher: Path, steps: int, *overrides: str) -> RunConfig:
    base = REPO_ROOT / "examples" / "grpo_tiny.yaml"
    data = apply_overrides(read_yaml(base), [
        f"data.train_path={SYNTH / 'prompts.jsonl'}", f"model.init_checkpoint={teacher}", "reward.rule=null",
        "reward.model=false", "eval.interval=0", "switches.dynamic_prompts=false", f"ppo.num_steps={steps}",
        *overrides], str(base))
    data["teacher_model"] = {**data["model"], "init_checkpoint": str(teacher)}
    return validate(RunConfig, data, "bench_teacher")


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows[1:])   # step 1 pays the start-up


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--teacher", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_teacher_") as tmp:
        root = Path(tmp)
        teacher = args.teacher or build_teacher(root)
        comp = run_and_wait(distill(teacher, args.steps, "actor.data_parallel=1"),
                            ["components.actor.tasks_per_node=1", "components.teacher.tasks_per_node=1"],
                            root / "component")
        colo = run_and_wait(distill(teacher, args.steps, "actor.data_parallel=2", "switches.colocated_teacher=true"),
                            ["components.actor.tasks_per_node=2"], root / "colocated")
    step_comp, step_colo = median(comp, "timers/step"), median(colo, "timers/step")
    wait = median(comp, "timers/critic_wait")
    print(f"component: step {step_comp:.3f} s (critic_wait {wait:.3f} s); colocated: step {step_colo:.3f} s "
          f"(median over steps 2..{args.steps})")
    print(f"teacher_component_over_colocated={step_comp / step_colo:.3f} teacher_wait_share={wait / step_comp:.3f}")


if __name__ == "__main__":
    main()
