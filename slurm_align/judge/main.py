"""The judge component's entry: every judge rank runs `main(run_dir)` (launchers/judge.py).

Rank 0 serves judge/server.py's endpoints and broadcasts each request as a command over the
component's channel (critic/channel.py); the other ranks follow; every rank runs the forward.
The judge's model is `judge.model` of the run config (its own size and parallel layout:
`judge.tensor_parallel`, `judge.pipeline_parallel`). It exits on judge_shutdown or with the job.
"""

from __future__ import annotations

from pathlib import Path

import torch

from slurm_align.config.run import RunConfig
from slurm_align.critic.channel import Command, CommandChannel
from slurm_align.critic.main import component_cli, component_main, serve_or_follow
from slurm_align.critic.server import ServerLimits
from slurm_align.judge.model import JudgeModel
from slurm_align.judge.server import JudgeServer
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


def run_judge(run: RunConfig, rd: RunDir, env, on_exit: list | None = None) -> int:
    jcfg = run.judge
    if jcfg.model is None:
        raise ValueError(f"{rd.config}: judge.model is not set; the judge component needs its model "
                         "(judge.model.init_checkpoint: a trained judge's checkpoints)")
    pctx = initialize_model_parallel(env, jcfg.tensor_parallel, jcfg.pipeline_parallel)
    worker = JudgeWorker(JudgeModel.load(jcfg.model, pctx, seed=run.seed))
    channel = CommandChannel(env.comm)
    server = JudgeServer.for_judge(rd, service_host("judge", run.critic_server.bind_host), jcfg.port,
                                   ServerLimits(max_seq_len=jcfg.model.max_seq_len, vocab_size=jcfg.model.vocab_size),
                                   worker.model) if env.rank == 0 else None
    serve_or_follow(server, channel, worker, on_exit, "judge", f"{env.world_size} ranks")
    pctx.destroy()
    return 0


def main(run_dir: str | Path) -> int:
    return component_main("judge", run_dir, run_judge)


def cli(argv: list[str] | None = None) -> int:
    return component_cli("slurm-align judge component (AI feedback over PyTriton)", main, argv)
