"""An evaluation job (`slurm-align eval`): every rank of the actor component loads the model
(model.init_checkpoint, or model.hf_path), refits its generation engine once and evaluates the
eval set (algorithms/evaluation.py: greedy, or eval.samples answers at eval.temperature with
pass@k), data-parallel over the generation replicas. Rank 0 writes the per-prompt rows to
RUN_DIR/eval/step_<N>.jsonl (N: the checkpoint's step, 0 for an HF folder) and the metrics to
RUN_DIR/eval/metrics_step_<N>.json, and prints them.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from slurm_align.algorithms.evaluation import EvalSet, evaluate, write_results
from slurm_align.algorithms.rollout_collector import RolloutCollector
from slurm_align.algorithms.standalone import checkpoint_step, load_standalone_actor
from slurm_align.config import RunConfig, load_run_config
from slurm_align.parallel.bootstrap import init_distributed
from slurm_align.rundir import RunDir, write_atomic


def metrics_path(rd: RunDir, step: int) -> Path:
    return rd.root / "eval" / f"metrics_step_{step}.json"


def run_eval(run: RunConfig, rd: RunDir, env) -> dict[str, float]:
    """Collective over the component: load, refit, evaluate; rank 0 writes the results."""
    actor = load_standalone_actor(run, env)
    pctx, tokenizer, engine, checkpoint = actor.pctx, actor.tokenizer, actor.engine, actor.checkpoint
    evalset = EvalSet.from_run(run, tokenizer)
    assert evalset is not None, "slurm-align eval sets eval.interval"
    collector = RolloutCollector(run, engine, tokenizer, [], None, rank=env.rank)
    with pctx.generation_layout(run.switches.refold) as layout:
        # the in-run evaluation's batch (ppo.PPOActor.evaluate): the same answers, batch for batch
        got = evaluate(collector, layout, env.comm, evalset, run.generation.max_new_tokens,
                       run.generation.prompt_batch_size * run.rl.n_samples_per_prompt)
    step = checkpoint_step(checkpoint)
    if got.rows is not None:
        metrics = dict(got.metrics)
        if not evalset.sampled:   # greedy: pass@1 is the share of full marks
            metrics["val/pass@1"] = sum(r["correct"] for r in got.rows) / len(got.rows)
        write_results(rd.eval_results(step), got.rows)
        write_atomic(metrics_path(rd, step), json.dumps({"step": step, "checkpoint": str(checkpoint or
                                                         run.model.hf_path), **metrics}, indent=1))
        print(json.dumps({"eval": {"step": step, **metrics}}), flush=True)
    collector.close()
    return got.metrics


def main(run_dir: str | Path) -> int:
    rd = RunDir(Path(run_dir))
    run = load_run_config(rd.config)
    env = init_distributed()
    try:
        run_eval(run, rd, env)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        env.comm.Abort(1)
    return 0
