"""The teacher component of on-policy distillation: every teacher rank runs `main(run_dir)`.

A frozen policy (run.teacher_model, weights from its init_checkpoint) behind the critic's own
secured PyTriton server (server.py: the run's secret checked before anything, HTTP only, the
address published tagged with the secret and this start of the job) and its command channel
(channel.py: rank 0 broadcasts each request, every rank runs it). No second server: the teacher
answers critic_infer with its next-token log-probs in the `values` output, in the critic's
per-position layout (position p predicts token p + 1, as the actor's own log-probs are laid out),
    values[b, p] = log p_teacher(tokens[b, p + 1] | tokens[b, :p + 1])   (0 at the last position),
and zeros as `rewards`; it trains and saves nothing. The actor's CriticClient(component="teacher")
calls it for each finished micro-batch, as it calls the critic, and turns the answer into the
sample's reward (algorithms/policy_gradient.teacher_scores).
"""

from __future__ import annotations

import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slurm_align.config.run import RunConfig
from slurm_align.critic.channel import Command, CommandChannel
from slurm_align.critic.main import TracedWorker, component_cli, component_main, load_reward_weights, serve_or_follow
from slurm_align.critic.server import CriticServer, ServerLimits
from slurm_align.models.forward import forward_logprobs
from slurm_align.models.gpt import build_gpt
from slurm_align.models.packing import Batching
from slurm_align.parallel import quiet
from slurm_align.parallel.layout import initialize_model_parallel
from slurm_align.profiling.timers import Tracer
from slurm_align.rundir import RunDir
from slurm_align.slurm.hetenv import service_host

COMPONENT = "teacher"


class TeacherWorker:
    """What every teacher rank does for a command: the collective forward of its rows (split over
    data-parallel ranks), gathered on rank 0."""

    def __init__(self, chunks: list, pctx: Any, comm, vocab_size: int, batching: Batching = Batching()):
        self.chunks, self.pctx, self.comm, self.vocab_size, self.batching = chunks, pctx, comm, vocab_size, batching
        for c in chunks:
            c.eval()
        self.holds_result = pctx.is_last_stage and pctx.tp_rank == 0

    def execute(self, cmd: Command) -> Any:
        handler = getattr(self, f"_{cmd.kind}", None)
        if handler is None:   # critic_train / critic_save: the teacher is frozen
            raise ValueError(f"teacher: '{cmd.kind}' is not served (the teacher is frozen; it answers infer only)")
        return handler(**cmd.data)

    def _rows(self, n: int) -> slice:
        bounds = np.linspace(0, n, self.pctx.dp_size + 1).round().astype(int)
        return slice(int(bounds[self.pctx.dp_rank]), int(bounds[self.pctx.dp_rank + 1]))

    @torch.no_grad()
    def _infer(self, tokens: np.ndarray, lengths: np.ndarray):
        rows = self._rows(tokens.shape[0])
        tok = torch.from_numpy(tokens[rows])
        part = None
        if tok.shape[0]:
            lp = forward_logprobs(self.chunks, self.pctx, tok, self.vocab_size,
                                  lengths=torch.from_numpy(lengths[rows]), batching=self.batching)
            if self.holds_result:
                assert lp is not None, "the last stage holds the log-probs"
                values = torch.zeros(tok.shape, dtype=torch.float32)
                values[:, :lp.shape[1]] = lp.float()   # position p: the log-prob of token p + 1
                part = (self.pctx.dp_rank, values.numpy())
        quiet.barrier(self.comm)
        parts = self.comm.gather(part, root=0)
        if parts is None:
            return None
        values = np.concatenate([p for _, p in sorted(p for p in parts if p is not None)]) if tokens.shape[0] \
            else np.zeros(tokens.shape, np.float32)
        return values, np.zeros(tokens.shape[0], np.float32)

    def _shutdown(self) -> None:
        return None


class ColocatedTeacher:
    """The teacher on the actor's own rank (switches.colocated_teacher): the component's answer,
    computed where the micro-batch is, when it is sent (nothing overlaps it). Has the client
    methods the actor calls."""

    def __init__(self, run: RunConfig, pctx: Any):
        mcfg = run.teacher_model
        assert mcfg is not None and mcfg.init_checkpoint is not None, "teacher_model is set"
        self.pctx, self.vocab_size = pctx, mcfg.vocab_size
        self.chunks = build_gpt(mcfg, pctx, seed=run.seed)
        load_reward_weights(Path(mcfg.init_checkpoint), self.chunks, pctx)
        for c in self.chunks:
            c.eval()

    @torch.no_grad()
    def infer_async(self, tokens: np.ndarray, lengths: np.ndarray, step: int | None = None) -> Future:
        lp = forward_logprobs(self.chunks, self.pctx, torch.from_numpy(tokens), self.vocab_size,
                              lengths=torch.from_numpy(lengths))
        assert lp is not None, "one stage: this rank holds the log-probs"
        values = np.zeros(tokens.shape, np.float32)
        values[:, :lp.shape[1]] = lp.float().numpy()
        done: Future = Future()
        done.set_result((values, np.zeros(tokens.shape[0], np.float32)))
        return done

    def shutdown_critic(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_teacher(run: RunConfig, rd: RunDir, env, on_exit: list | None = None) -> int:
    mcfg = run.teacher_model
    assert mcfg is not None and mcfg.init_checkpoint is not None, "the teacher kind is declared by teacher_model"
    pctx = initialize_model_parallel(env, run.teacher.tensor_parallel, run.teacher.pipeline_parallel)
    chunks = build_gpt(mcfg, pctx, seed=run.seed)
    load_reward_weights(Path(mcfg.init_checkpoint), chunks, pctx)   # a checkpoint folder or a full state dict
    channel = CommandChannel(env.comm)
    tracer = Tracer(rd.root, COMPONENT, env.rank)
    worker = TracedWorker(TeacherWorker(chunks, pctx, env.comm, mcfg.vocab_size), tracer)  # type: ignore[arg-type]
    # port 0: a free port (a fixed critic_server.port is the critic's, which may share the node)
    server = CriticServer.for_run(rd, service_host(COMPONENT, run.critic_server.bind_host), 0,
                                  ServerLimits(max_seq_len=mcfg.max_seq_len, vocab_size=mcfg.vocab_size),
                                  component=COMPONENT) if env.rank == 0 else None
    serve_or_follow(server, channel, worker, on_exit, COMPONENT, f"{env.world_size} ranks, "
                    f"TP={pctx.tp_size} PP={pctx.pp_size} DP={pctx.dp_size}")
    tracer.close()
    pctx.destroy()
    return 0


def main(run_dir: str | Path) -> int:
    return component_main(COMPONENT, run_dir, run_teacher)


def cli(argv: list[str] | None = None) -> int:
    return component_cli("slurm-align teacher component (on-policy distillation over PyTriton)", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
