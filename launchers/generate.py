"""The ranks of a batch-generation job (`slurm-align generate`): slurm_align.algorithms.generate.

Usage (the job script does this on each rank): python -m slurm_align.launchers.generate --run-dir RUN_DIR
--data FILE [--samples N] [--temperature T] [--top-k-logprobs K] [--shard-size S] [--max-new-tokens M]
"""

import argparse
import sys
import traceback

if __name__ == "__main__":   # heavy imports under the guard, as launchers/actor.py explains
    from pathlib import Path

    from slurm_align.launchers import importing, leave

    with importing():
        from slurm_align.algorithms.generate import GenerateSpec, run_generate
        from slurm_align.config import load_run_config
        from slurm_align.parallel.bootstrap import init_distributed
        from slurm_align.rundir import RunDir

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k-logprobs", type=int, default=0)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    args = parser.parse_args()
    rd = RunDir(Path(args.run_dir))
    run = load_run_config(rd.config)
    spec = GenerateSpec(samples=args.samples, temperature=args.temperature, top_k_logprobs=args.top_k_logprobs,
                        shard_size=args.shard_size, seed=run.seed,
                        max_new_tokens=args.max_new_tokens or run.generation.max_new_tokens)
    env = init_distributed()
    try:
        run_generate(run, rd, env, args.data, spec)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        env.comm.Abort(1)
    leave(0)
