"""The judge component's entry: every judge rank runs `main(run_dir)` (launchers/judge.py).

Rank 0 serves judge/server.py's endpoints and broadcasts each request as a command over the
component's channel (critic/channel.py); the other ranks follow; every rank runs the forward.
The judge's model is `judge.model` of the run config (its own size and parallel layout:
`judge.tensor_parallel`, `judge.pipeline_parallel`). It exits on judge_shutdown or with the job.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

from slurm_align.config import load_run_config
from slurm_align.config.run import RunConfig
from slurm_align.critic.channel import Command, CommandChannel
from slurm_align.critic.server import ServerLimits
from slurm_align.judge.model import JudgeModel
from slurm_align.judge.server import JudgeServer
from slurm_align.parallel.bootstrap import init_distributed
from slurm_align.parallel.layout import initialize_model_parallel
from slurm_align.rundir import RunDir
from slurm_align.slurm.hetenv import service_host


class JudgeWorker:
    def __init__(self, model: JudgeModel):
        self.model = model

    def execute(self, cmd: Command):
        if cmd.kind == "infer":
            return self.model.answer_logprobs_tokens(torch.as_tensor(cmd.data["tokens"]),
                                                     torch.as_tensor(cmd.data["lengths"]),
                                                     [int(i) for i in cmd.data["answer_ids"]])
        if cmd.kind == "shutdown":
            return None
        raise ValueError(f"judge: unexpected command {cmd.kind!r}")


def run_judge(run: RunConfig, rd: RunDir, env) -> int:
    jcfg = run.judge
    if jcfg.model is None:
        raise ValueError(f"{rd.config}: judge.model is not set; the judge component needs its model "
                         "(judge.model.init_checkpoint: a trained judge's checkpoints)")
    pctx = initialize_model_parallel(env, jcfg.tensor_parallel, jcfg.pipeline_parallel)
    worker = JudgeWorker(JudgeModel.load(jcfg.model, pctx, seed=run.seed))
    channel = CommandChannel(env.comm)
    if env.rank == 0:
        server = JudgeServer.for_judge(rd, service_host("judge", run.critic_server.bind_host), jcfg.port,
                                       ServerLimits(max_seq_len=jcfg.model.max_seq_len,
                                                    vocab_size=jcfg.model.vocab_size), worker.model)
        server.start()
        print(f"judge: serving on {server.host}:{server.port} ({env.world_size} ranks)", flush=True)
        try:
            while True:
                pending = server.next_command(timeout=1.0)
                if pending is None:
                    continue
                channel.send(pending.command)
                try:
                    result = worker.execute(pending.command)
                except BaseException as exc:
                    pending.result.set_exception(exc)
                    raise
                pending.result.set_result(result)
                if pending.command.kind == "shutdown":
                    time.sleep(0.5)   # let the answer to the shutdown go out
                    break
        finally:
            server.stop()
    else:
        while True:
            cmd = channel.recv()
            worker.execute(cmd)
            if cmd.kind == "shutdown":
                break
    pctx.destroy()
    return 0


def main(run_dir: str | Path) -> int:
    rd = RunDir(Path(run_dir))
    run = load_run_config(rd.config)
    env = init_distributed()
    try:
        return run_judge(run, rd, env)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        env.comm.Abort(1)
        raise


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="slurm-align judge component (AI feedback over PyTriton)")
    ap.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    return main(ap.parse_args(argv).run_dir)
