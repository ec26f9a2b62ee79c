"""The critic component's entry: every critic rank runs `main(run_dir)`.

Rank 0 serves the PyTriton endpoints and broadcasts each request as a command; the other
ranks follow. All ranks exit when the actor sends critic_shutdown (or the job ends).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from slurm_align.config import load_run_config
from slurm_align.config.run import RunConfig
from slurm_align.critic.channel import Command, CommandChannel
from slurm_align.critic.server import CriticServer, ServerLimits
from slurm_align.critic.swap import REWARD, VALUE, ModelSwap
from slurm_align.critic.worker import CriticWorker
from slurm_align.models.checkpoint import find_latest, load_weights, verify_checkpoint
from slurm_align.models.gpt import build_gpt
from slurm_align.models.packing import run_batching
from slurm_align.models.weights import full_state_dict, load_full_state_dict
from slurm_align.parallel.bootstrap import init_distributed
from slurm_align.parallel.layout import initialize_model_parallel
from slurm_align.profiling import phases
from slurm_align.profiling.timers import Tracer
from slurm_align.rundir import RunDir
from slurm_align.slurm.hetenv import service_host
from slurm_align.slurm.preemption import enter_role


def load_full_weights(path: Path) -> dict[str, torch.Tensor]:
    """A full state dict file, as written by critic_save."""
    return torch.load(path, map_location="cpu", weights_only=True)


def load_reward_weights(path: Path, chunks: list, pctx) -> None:
    """init_checkpoint: a sharded checkpoint folder (the RM trainer's iter_* or its checkpoints
    folder, newest complete one) or a full-state-dict file written by critic_save."""
    if path.is_file():
        load_full_state_dict(chunks, pctx, load_full_weights(path))
    elif path.is_dir():
        load_weights(find_latest(path) or path, chunks)
    else:
        raise FileNotFoundError(f"critic_model.init_checkpoint={str(path)!r} does not exist (expected a "
                                "checkpoint folder from the RM trainer or a critic_save file)")


def build_models(run: RunConfig, pctx) -> dict[str, list]:
    """Reward model (from init_checkpoint when set) and a value model initialised from it; the
    reward model alone when the algorithm has no value model (grpo, rloo, ...: reward-only)."""
    mcfg = run.critic_model_config
    reward = build_gpt(mcfg, pctx, value_head=True, seed=run.seed)
    if mcfg.init_checkpoint is not None:
        load_reward_weights(Path(mcfg.init_checkpoint), reward, pctx)
    if not run.critic_trains:
        return {REWARD: reward}
    # The value model is scalar whatever the reward model's attributes (a regression RM's heads).
    value = build_gpt(mcfg.model_copy(update={"num_labels": 1}), pctx, value_head=True, seed=run.seed + 1,
                      training=run.training)
    # As NeMo-Aligner does: the critic starts as a copy of the reward model (its trunk only
    # when the reward model has several attributes: the value head then starts fresh).
    state = full_state_dict(reward, pctx, to_all=True)
    assert state is not None, "to_all: every rank gets the weights"
    if mcfg.num_labels > 1:
        own = full_state_dict(value, pctx, to_all=True)
        assert own is not None
        state = {k: (own[k] if k.startswith("value_head.") else v) for k, v in state.items()}
    load_full_state_dict(value, pctx, state)
    return {VALUE: value, REWARD: reward}


class TracedWorker:
    """Runs commands with a trace span (critic_infer / critic_train) on this rank.

    The span's step is the actor's PPO step when the request carried one, else the last seen."""

    PHASES: ClassVar[dict[str, str]] = {"infer": phases.CRITIC_INFER, "train": phases.CRITIC_TRAIN}

    def __init__(self, worker: CriticWorker, tracer: Tracer):
        self.worker, self.tracer, self.step = worker, tracer, 0

    def execute(self, cmd: Command):
        step = cmd.data.pop("step", None)
        if step is not None:
            self.step = int(step)
        phase = self.PHASES.get(cmd.kind)
        if phase is None:
            self.tracer.flush()
            return self.worker.execute(cmd)
        with self.tracer.span(phase, self.step):
            return self.worker.execute(cmd)


class Executes(Protocol):
    """What serve/follow drive: the critic's TracedWorker, the teacher's, the judge's worker."""

    def execute(self, cmd: Command) -> Any: ...


def serve(server: CriticServer, channel: CommandChannel, worker: Executes) -> None:
    """Rank 0: take commands from the HTTP endpoints one by one, broadcast, execute, answer (a
    served component's loop: the critic's, the teacher's, the judge's)."""
    while True:
        pending = server.next_command(timeout=1.0)
        if pending is None:
            continue
        channel.send(pending.command)
        try:
            result = worker.execute(pending.command)
        except BaseException as exc:  # a bug, not bad input (that is rejected before): stop all ranks
            pending.result.set_exception(exc)
            raise
        pending.result.set_result(result)
        if pending.command.kind == "shutdown":
            time.sleep(0.5)  # let the HTTP answer to the shutdown request go out
            return


def follow(channel: CommandChannel, worker: Executes) -> None:
    """Ranks > 0: execute rank 0's commands until shutdown."""
    while True:
        cmd = channel.recv()
        worker.execute(cmd)
        if cmd.kind == "shutdown":
            return


def serve_or_follow(server: CriticServer | None, channel: CommandChannel, worker: Executes,
                    on_exit: list | None, name: str, shape: str) -> None:
    """A served component's ranks until shutdown: rank 0 (given its server) starts it, serves and
    stops it; the others follow rank 0's commands. `name` and `shape` make rank 0's banner."""
    if server is None:
        follow(channel, worker)
        return
    server.start()
    if on_exit is not None:
        on_exit.append(server.stop)   # a TERM exit stops tritonserver too (it would keep the port)
    print(f"{name}: serving on {server.host}:{server.port} ({shape})", flush=True)
    try:
        serve(server, channel, worker)
    finally:
        server.stop()


def component_main(kind: str, run_dir: str | Path, run_component: Callable[..., int]) -> int:
    """A component's process: its run's config, MPI, its kind's preemption role (the served kinds
    'survive': USR2 ignored, the actor decides when to stop; Slurm's preemption TERM: serve on
    until the actor stopped), then `run_component(run, rd, env, on_exit)`."""
    rd = RunDir(Path(run_dir))
    run = load_run_config(rd.config)
    env = init_distributed()
    on_exit = enter_role(kind, rd)
    try:
        return run_component(run, rd, env, on_exit)
    except BaseException:
        # The other ranks wait for rank 0's next command (or rank 0 for their part of a
        # collective) forever: print why, then take the whole component down at once.
        traceback.print_exc()
        sys.stderr.flush()
        env.comm.Abort(1)
        raise


def component_cli(description: str, main: Callable[[str], int], argv: list[str] | None) -> int:
    """`python -m <component module> --run-dir DIR`: what the job script runs."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    return main(ap.parse_args(argv).run_dir)


def resume_step(rd: RunDir) -> int | None:
    """The step of the actor's newest complete checkpoint: a resumed PPO run redoes the steps
    after it, so the critic takes its value model from that step and drops later spans."""
    latest = find_latest(rd.checkpoints("actor"))
    return None if latest is None else int(verify_checkpoint(latest)["step"])


def bind_host(run: RunConfig) -> str:
    """critic_server.bind_host, else this node's address (slurm.hetenv.service_host)."""
    return service_host("critic", run.critic_server.bind_host)


def restore(worker: CriticWorker, rd: RunDir, step: int, pctx) -> None:
    """The value model as it was at the actor's checkpoint `step`: weights, AdamW state and RNG
    (iter_<step>/), or only the weights from an older run's iter_<step>.pt."""
    state = rd.checkpoints("critic") / f"iter_{step:07d}"
    weights = state.with_name(state.name + ".pt")
    if state.is_dir():
        worker.load_training_state(state)
    elif weights.is_file():
        print(f"critic: {state} is missing: resuming with the weights of {weights.name} and a fresh "
              "optimizer state", flush=True)
        load_full_state_dict(worker.swap.models[VALUE], pctx, load_full_weights(weights))
    else:
        raise FileNotFoundError(f"the actor resumes from step {step}, but the critic has no checkpoint "
                                f"of that step ({state} or {weights.name})")


def main(run_dir: str | Path) -> int:
    return component_main("critic", run_dir, run_critic)


def run_critic(run: RunConfig, rd: RunDir, env, on_exit: list | None = None) -> int:
    pctx = initialize_model_parallel(env, run.critic.tensor_parallel, run.critic.pipeline_parallel)
    models = build_models(run, pctx)
    swap = ModelSwap(models, keep_resident=run.switches.keep_critic_models_resident)
    worker = CriticWorker(swap, pctx, env.comm, lr=run.ppo.critic_lr, value_clip=run.ppo.value_clip,
                          grad_clip=run.ppo.critic_grad_clip, checkpoint_dir=rd.checkpoints("critic"),
                          batching=run_batching(run, "critic"), training=run.training,
                          total_steps=run.ppo.num_steps, reward_weights=run.reward.attribute_weights
                          if run.critic_model_config.num_labels > 1 else None, model_cfg=run.critic_model_config)
    resumed = resume_step(rd)
    if resumed is not None and run.critic_trains:   # a reward-only critic has no state of its own
        restore(worker, rd, resumed, pctx)
    channel = CommandChannel(env.comm)
    tracer = Tracer(rd.root, "critic", env.rank, resume_from_step=None if resumed is None else resumed + 1)
    worker = TracedWorker(worker, tracer)
    mcfg = run.critic_model_config
    server = CriticServer.for_run(rd, bind_host(run), run.critic_server.port,
                                  ServerLimits(max_seq_len=mcfg.max_seq_len, vocab_size=mcfg.vocab_size)) \
        if env.rank == 0 else None
    serve_or_follow(server, channel, worker, on_exit, "critic", f"{env.world_size} ranks, "
                    f"TP={pctx.tp_size} PP={pctx.pp_size} DP={pctx.dp_size}")
    tracer.close()
    print(f"critic rank {env.rank}: shut down after {swap.swaps} model swaps", flush=True)
    pctx.destroy()
    return 0


def cli(argv: list[str] | None = None) -> int:
    return component_cli("slurm-align critic component (value + reward over PyTriton)", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
