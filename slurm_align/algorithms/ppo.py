"""The actor loop of PPO and its family (every rank of the actor component runs `main`).

One step, as in ../shared/DESIGN.md ("Data flow of one PPO step") and as `PPOActor.step` reads:

    refit -> generate (prompt server, PP refolded into DP; each finished micro-batch goes to the
    critic at once) -> rebalance (one alltoall: each training DP rank gets its token-balanced
    shard as a RolloutBatch) -> logprobs / init_logprobs on the shard (init_logprobs, the
    reference's, only where a KL term reads them: RunConfig.uses_reference; the critic works
    meanwhile) -> critic_wait (values and rewards follow their samples along the same route) ->
    advantages (KL-penalised rewards, GAE, whitening by all-reduce) -> rank 0 gathers the step
    -> store -> train (the critic's update goes out first and overlaps it)

GRPO, RLOO, REINFORCE++ and rejection sampling run the same loop (algorithms/policy_gradient.py):
n_samples_per_prompt samples per prompt (a group, kept on one DP rank), no critic unless a
reward model scores, their own advantages and loss. A rule reward scores each micro-batch on the
rank that generated it; `eval:` scores greedy answers to held-out prompts (val/ metrics).

Generation itself (prompt order, per-sample seeds, engine calls, rule rewards, critic dispatch)
is the rollout collector's (algorithms/rollout_collector.py). With rollout.mode 'disaggregated'
the generator component runs it instead (algorithms/generator.py): the step's samples arrive
over its stream (no refit, no generate here), samples older than rollout.max_off_policy_steps
versions get train weight 0, and after the update the weights go back (weight_sync).

Every phase is a span in RUN_DIR/traces.zarr. Rollouts go to RUN_DIR/rollouts.zarr (rank 0).
Steps count from 1, as in the trainers: step k's metrics, spans and rollouts carry k, and
checkpoint iter_k holds the state after k steps.
Construction (models, engine on the rank's device and generation layout, critic client, stores)
is `build_actor`, apart from the loop.
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch
from rich.progress import Progress

from slurm_align.algorithms.evaluation import EvalSet, evaluate, write_results
from slurm_align.algorithms.generator import RemoteRollouts, stale_mask
from slurm_align.algorithms.policy_gradient import (
    PolicyUpdate,
    Rewards,
    actor_optimizer_steps,
    combine_rewards,
    estimate_advantages,
    teacher_score,
)
from slurm_align.algorithms.rollout_batch import RolloutBatch, all_reduce_sums
from slurm_align.algorithms.rollout_collector import RolloutCollector, Scores
from slurm_align.config import RunConfig, load_run_config
from slurm_align.critic.client import CriticClient
from slurm_align.critic.teacher import ColocatedTeacher
from slurm_align.data.mixture import run_prompts
from slurm_align.generation import Engine, engine_from_config
from slurm_align.generation.memory import TrainingStateOffload, generation_phase
from slurm_align.generation.params import logprob_temperature
from slurm_align.generation.refit import refit_from_training
from slurm_align.models.checkpoint import (
    AsyncCheckpointWriter,
    find_latest,
    load_checkpoint,
    save_checkpoint,
)
from slurm_align.models.forward import forward_logprobs
from slurm_align.models.lora import lora_base
from slurm_align.models.moe_stats import RouterStats
from slurm_align.models.optimizer import ModelOptimizer
from slurm_align.models.packing import run_batching
from slurm_align.models.retention import apply_retention
from slurm_align.models.tokenizer import build_tokenizer
from slurm_align.models.worker import ModelWorker
from slurm_align.parallel import quiet
from slurm_align.parallel.bootstrap import DistEnv, init_distributed
from slurm_align.parallel.layout import ParallelContext, initialize_model_parallel
from slurm_align.profiling import phases as P
from slurm_align.profiling.device import ProfilerWindow, device_hooks
from slurm_align.profiling.metrics import MetricsLogger
from slurm_align.profiling.timers import Tracer
from slurm_align.profiling.watchdog import Watchdog
from slurm_align.rundir import RunDir
from slurm_align.slurm.preemption import StopPoint
from slurm_align.store.rollouts import TOKEN_FIELDS, RolloutStore

STORED_SAMPLE_FIELDS = ("reward", "is_end", "rank", "version")
"""Per-sample columns the rollout store keeps (its per-token ones are store.rollouts.TOKEN_FIELDS)."""


def actor_engine(run: RunConfig, env: DistEnv, pctx: ParallelContext) -> Engine:
    """The generation engine on this rank's device (cuda:local_rank, or cpu) in the generation
    layout (TensorRT-LLM takes its TP from it). Collective: the layout's groups are built here."""
    with pctx.generation_layout(run.switches.refold) as layout:
        return engine_from_config(run, env.device, layout)


class PPOActor:
    """One actor rank's parts (made by `build_actor`) and the PPO loop over them."""

    def __init__(self, run: RunConfig, rd: RunDir, env: DistEnv, pctx: ParallelContext, *, tokenizer,
                 prompts: Sequence[np.ndarray], worker: ModelWorker,
                 offload: TrainingStateOffload | None, engine: Engine, critic: CriticClient | None, tracer: Tracer,
                 store: RolloutStore | None, metrics: MetricsLogger, start_step: int, rewards: Rewards,
                 evalset: EvalSet | None, remote: RemoteRollouts | None = None,
                 teacher: CriticClient | ColocatedTeacher | None = None):
        self.run, self.rd, self.env, self.pctx = run, rd, env, pctx
        self.rank = env.rank
        self.tokenizer, self.prompts = tokenizer, prompts
        # The policy's model worker (models/worker.py) holds the model, its optimizer and the frozen
        # reference; the update trains through its step.
        self.worker = worker
        assert worker.reference is not None, "the actor's worker holds the reference policy"
        self.policy, self.optimizer, self.reference = worker.chunks, worker.optimizer, worker.reference
        self.offload = offload
        self.engine, self.critic, self.tracer, self.store, self.metrics = engine, critic, tracer, store, metrics
        self.start_step = start_step
        self.rewards, self.evalset = rewards, evalset
        self.init_checkpoint: Path | None = None   # the resolved model.init_checkpoint (build_actor sets it)
        self.remote = remote   # rollout.mode 'disaggregated': the generator component's stream
        self.writer = AsyncCheckpointWriter() if run.checkpointing.async_save else None
        self._writing_step: int | None = None   # the step the writer is (or was last) saving
        self.collected_metrics: dict[str, float] = {}
        assert run.spec.loss is not None, "config.algorithms: a rollout algorithm has a loss"
        self.update = PolicyUpdate(run, worker, loss=run.spec.loss)
        self.pad_id = tokenizer.pad_id
        self.collector = RolloutCollector(run, engine, tokenizer, prompts, rewards, rank=env.rank, tracer=tracer,
                                          critic=critic, teacher=teacher)
        self.teacher = teacher   # on-policy distillation: the teacher component's client
        # MoE: per-expert load and the load-balancing loss of the update's forward passes
        self.router_stats = RouterStats(self.policy, run.model.num_experts) if run.model.num_experts else None

    # -- phases ------------------------------------------------------------------------------
    def generate(self, step: int) -> tuple[RolloutBatch, list[tuple[RolloutBatch, Scores | None]]]:
        """Refit, then the collector generates this rank's share of the step's prompts (rule
        rewards, critic dispatch: algorithms/rollout_collector.py). Returns this rank's rollouts
        (empty on ranks that do not request prompts) and the critic futures (None without a
        critic) with their micro-batches."""
        run = self.run
        with self.tracer.span(P.REFIT, step):
            refit_from_training(self.engine, self.policy, self.pctx, refold=run.switches.refold)
        self.collector.set_version(step - 1)   # the weights after step - 1 optimizer steps
        with self.pctx.generation_layout(run.switches.refold) as layout:
            got = self.collector.collect(step, self.env.comm, layout)
        self.collected_metrics = got.metrics   # dynamic sampling's, logged with the step's rollouts
        return got.batch, got.pending

    def receive(self, step: int) -> tuple[RolloutBatch, list[tuple[RolloutBatch, Scores | None]]]:
        """Disaggregated: the step's samples from the generator (all on rank 0; the rebalance
        spreads them), each micro-batch sent on to the critic as it comes (PPO's values, a
        reward model's score). Waiting for them is the trainer's idle time (no span)."""
        assert self.remote is not None, "receive() is the disaggregated path"
        mbs = self.remote.receive(step)
        quiet.barrier(self.env.comm)   # the other ranks wait for rank 0's samples without spinning
        return RolloutBatch.cat(mbs, self.pad_id), [(mb, self.collector.to_critic(mb, step)) for mb in mbs]

    def weight_sync(self, step: int) -> dict[str, float]:
        """Disaggregated: the weights after `step` optimizer steps to the generator (not after
        the last step: nobody generates with them)."""
        if self.remote is None or step >= self.run.ppo.num_steps:
            return {}
        with self.tracer.span(P.WEIGHT_SYNC, step):
            got = self.remote.sync(self.policy, self.pctx, version=step)
        return {"bytes": got["weight_sync_bytes"], "seconds": got["weight_sync_s"]}

    @torch.no_grad()
    def logprobs(self, shard: RolloutBatch, step: int) -> None:
        """Policy and reference log-probs of the shard's responses (every rank of the shard's
        model-parallel group gets them). The reference pass only where a KL term reads it
        (run.uses_reference); otherwise ref_logprobs is NaN (so is its stored column)."""
        vocab = self.run.model.vocab_size
        batching = run_batching(self.run, "actor", self.run.ppo.train_micro_batch_size)
        temperature = logprob_temperature(self.run.generation.temperature)   # the engine's, too

        def response_logprobs() -> torch.Tensor:
            logp = forward_logprobs(self.policy, self.pctx, shard.tokens, vocab, lengths=shard.seq_lengths,
                                    batching=batching, broadcast=True, temperature=temperature)
            assert logp is not None, "broadcast=True: every stage gets the last stage's log-probs"
            return shard.from_positions(logp)

        with self.tracer.span(P.LOGPROBS, step):
            shard.set_tokens("logprobs", response_logprobs())
        if not self.run.uses_reference:
            shard.set_tokens("ref_logprobs", torch.full_like(shard["logprobs"], float("nan")))
            return
        with self.tracer.span(P.INIT_LOGPROBS, step):
            self.reference.swap()
            try:
                shard.set_tokens("ref_logprobs", response_logprobs())
            finally:
                self.reference.swap()

    def critic_results(self, pending: list[tuple[RolloutBatch, Scores | None]], step: int) -> RolloutBatch:
        """This rank's micro-batches with the critic's values (per response token; 0 without a
        critic) and the reward: the reward model's score and the rule reward, weighted."""
        with self.tracer.span(P.CRITIC_WAIT, step):
            for mb, fut in pending:
                values, model_score, teacher_lp = fut.result() if fut is not None else (None, None, None)
                mb.set_tokens("values", torch.zeros_like(mb.mask) if values is None else
                              mb.from_positions(torch.from_numpy(values)))
                teacher = None if teacher_lp is None else \
                    teacher_score(mb, mb.from_positions(torch.from_numpy(teacher_lp)))
                mb.set_samples("reward", combine_rewards(self.run, None if model_score is None else
                                                         torch.from_numpy(model_score), mb.samples.get("rule_reward"),
                                                         teacher, mb.samples.get("judge_score")))
        return RolloutBatch.cat([mb for mb, _ in pending], self.pad_id)

    def gather_step(self, shard: RolloutBatch) -> RolloutBatch | None:
        """The whole step on rank 0 (for the store and the critic's update), in index order: one
        gather from the DP ranks' model-parallel leaders. None on the other ranks."""
        if self.pctx.tp_rank or self.pctx.pp_rank:
            return None
        quiet.barrier(self.pctx.dp_comm)
        parts = self.pctx.dp_comm.gather(shard.pack(), root=0)
        return None if parts is None else RolloutBatch.unpack(parts, self.pad_id).sorted_by("index")

    def critic_train(self, step_batch: RolloutBatch | None, step: int) -> Future | None:
        """Rank 0 sends the value-model update for the whole step; the actor trains meanwhile."""
        if step_batch is None or not self.run.critic_trains:
            return None
        b = step_batch
        assert self.critic is not None, "RunConfig.critic_trains: the run has a critic"
        return self.critic.train_async(b.tokens.numpy(), b.seq_lengths.numpy(), b.to_positions("returns").numpy(),
                                       b.to_positions("values").numpy(), b.position_mask().numpy(), step=step)

    def train(self, shard: RolloutBatch, step: int) -> dict:
        """The policy update on this DP rank's shard: epochs x optimizer batches (grads summed
        over DP); the clipped surrogate, or the SFT loss for rejection sampling. MoE: the
        router statistics of the update's forward passes (moe/*)."""
        if self.router_stats is not None:
            self.router_stats.reset()   # the log-prob passes routed too; those are not the update's
        out = self.update.train(shard, step, self.tracer)
        if self.router_stats is not None:
            out.update(self.router_stats.collect())   # collective over the actor's ranks
        return out

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out task score of the policy after `step` steps (refit, greedy answers); a
        span of step `step` (none for the initial policy, step 0, which is not a training step).
        Rank 0 writes the per-prompt outcome to RUN_DIR/eval/step_<step>.jsonl (evaluation.py)."""
        run = self.run
        span = self.tracer.span(P.EVALUATE, step) if step > 0 else contextlib.nullcontext()
        with span, generation_phase(self.engine, self.offload, free_engine_after=False):
            refit_from_training(self.engine, self.policy, self.pctx, refold=run.switches.refold)
            assert self.evalset is not None, "EvalSet.due: evaluation is on"
            with self.pctx.generation_layout(run.switches.refold) as layout:
                got = evaluate(self.collector, layout, self.env.comm, self.evalset, run.generation.max_new_tokens,
                               run.generation.prompt_batch_size * run.rl.n_samples_per_prompt)
            if got.rows is not None:
                write_results(self.rd.eval_results(step), got.rows)
        return got.metrics

    def rollout_metrics(self, shard: RolloutBatch) -> dict:
        """Means over the whole step (sums all-reduced over DP)."""
        mask = shard.mask
        # kl: only where the reference pass ran (run.uses_reference)
        kl = ((shard["logprobs"] - shard["ref_logprobs"]) * mask).sum() if self.run.uses_reference else 0.0
        s = all_reduce_sums({"reward": shard["reward"].double().sum(), "samples": shard.size, "kl": kl,
                             "tokens": mask.sum(), "ended": shard["is_end"].sum()}, self.pctx.dp_group)
        out = {"rewards": s["reward"] / s["samples"],
               **({"kl": s["kl"] / s["tokens"]} if self.run.uses_reference else {}),
               "response_lengths": s["tokens"] / s["samples"],   # the model's tokens (multi-turn: mask)
               "fraction_of_samples_properly_ended": s["ended"] / s["samples"]}
        if "turns" in shard.samples:   # multi-turn: per-conversation means
            t = all_reduce_sums({k: shard[k].double().sum() for k in ("turns", "tool_calls", "tool_errors")},
                                self.pctx.dp_group)
            out.update({k: v / s["samples"] for k, v in t.items()})
        return out

    # -- the loop ----------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        run, pctx = self.run, self.pctx
        if self.remote is None:
            with generation_phase(self.engine, self.offload, free_engine_after=False):
                local, pending = self.generate(step)
        else:
            local, pending = self.receive(step)
        with self.tracer.span(P.REBALANCE, step):
            route = local.route(self.env.comm, pctx.dp_rank, pctx.dp_size, expected=run.rollouts_per_step)
            shard = local.moved(route)
        self.logprobs(shard, step)   # the critic works on the futures meanwhile
        results = self.critic_results(pending, step)
        with self.tracer.span(P.REBALANCE, step):
            shard.merge(results.moved(route, samples=["index", "reward"], per_token=["values"], with_tokens=False))
            advantage_metrics = estimate_advantages(run, shard, pctx.dp_group)
            if self.remote is not None:   # never train on a sample older than k versions
                advantage_metrics.update(stale_mask(run, shard, step, pctx.dp_group))
            step_batch = self.gather_step(shard)
        with self.tracer.span(P.STORE, step):
            if self.store is not None:
                assert step_batch is not None, "rank 0 holds both the store and the gathered step"
                self.store.append_step(step, step_batch.store_columns(TOKEN_FIELDS, STORED_SAMPLE_FIELDS))
        critic_future = self.critic_train(step_batch, step)
        warmup = run.critic_trains and step <= run.ppo.critic_warmup_steps   # only the critic trains
        optim = {} if warmup else self.train(shard, step)
        if critic_future is not None:
            with self.tracer.span(P.CRITIC_WAIT, step):
                optim["critic_loss"] = critic_future.result()
        sync = self.weight_sync(step)
        # Named as NeMo-Aligner users know them: train_rollouts/, train_optim/, timers/.
        val = self.evaluate(step) if self.evalset is not None and self.evalset.due(run, step) else {}
        rollouts = {**self.rollout_metrics(shard), **advantage_metrics, **self.collected_metrics}
        return {"step": step, **val, **{f"train_rollouts/{k}": v for k, v in rollouts.items()},
                **{f"train_optim/{k}": v for k, v in optim.items()},
                **{f"weight_sync/{k}": v for k, v in sync.items()},
                **{f"timers/{k}": v for k, v in self.tracer.durations(step).items()},
                # device memory peak per phase (bytes), where CUDA is available (profiling/device.py)
                **{f"memory/{k}": v for k, v in self._device_memory(step).items()}}

    def _device_memory(self, step: int) -> dict[str, int]:
        return self.tracer.device.memory(step) if self.tracer.device is not None else {}

    def save_checkpoint(self, step: int) -> None:
        """Save both roles (the `save` phase of the step). With checkpointing.async_save the
        actor's write and commit go on in the background (self.writer); wait_for_save() joins."""
        with self.tracer.span(P.SAVE, step):
            if self.writer is not None:
                self.writer.wait()   # the previous write committed first (its critic file with it)
            if self.store is not None:
                self.store.flush()   # no checkpoint ahead of the committed rollouts (resume leaves no gap)
            # The critic first: the actor's manifest, written last, commits the step for both roles.
            if self.rank == 0 and self.run.critic_trains:
                assert self.critic is not None, "RunConfig.critic_trains: the run has a critic"
                self.critic.save(str(self.rd.checkpoints("critic") / f"iter_{step:07d}.pt"))
            critic = self.rd.checkpoints("critic")

            def prune() -> None:   # committed for both roles: older steps may go, the critic's file with the actor's
                apply_retention(self.run.checkpointing, self.rd.checkpoints("actor"), self.metrics.path,
                                companions=lambda s: [critic / f"iter_{s:07d}.pt"])

            common = {"algorithm": self.run.algorithm, **lora_base(self.run.model, self.run.seed, self.init_checkpoint)}
            if self.writer is not None:
                self._writing_step = step
                self.writer.save(self.rd.checkpoints("actor"), step, self.policy, self.optimizer, common, prune)
                return
            save_checkpoint(self.rd.checkpoints("actor"), step, self.policy, self.optimizer, common)
            if self.rank == 0:
                prune()

    def save_and_wait(self, step: int) -> None:
        """A stop for preemption: `step` saved and committed (a write of it under way is joined)."""
        if self.writer is None or self._writing_step != step:
            self.save_checkpoint(step)
        self.wait_for_save()

    def wait_for_save(self) -> None:
        if self.writer is not None:
            self.writer.wait()

    def run_loop(self, stop: StopPoint | None = None) -> bool:
        """Run the remaining steps; True when `stop` ended the run early (after saving)."""
        run = self.run
        with Progress(disable=self.rank != 0, transient=False) as progress:
            task = progress.add_task(run.algorithm, total=run.ppo.num_steps, completed=self.start_step - 1)
            if self.remote is not None:   # the generator starts from the trainer's weights
                self.remote.connect(self.start_step)
                self.remote.sync(self.policy, self.pctx, version=self.start_step - 1)
            if self.evalset is not None and self.start_step == 1:
                self.log({"step": 0, **self.evaluate(0)}, progress.console)   # the initial policy
            window = ProfilerWindow(run.profiling.steps, self.rd.root / "profile" / f"actor_rank{self.rank}.json")
            for step in range(self.start_step, run.ppo.num_steps + 1):
                if stop is not None:
                    stop.step_begins()
                window.step_begins(step)
                t0 = time.perf_counter()
                metrics = self.step(step)
                metrics["timers/step"] = time.perf_counter() - t0
                window.step_ends(step)
                self.tracer.step_done(step)
                last = step == run.ppo.num_steps
                saved = bool((run.ppo.save_interval and step % run.ppo.save_interval == 0) or last)
                # Metrics before the checkpoint: a checkpoint then always has its step's metrics
                # (a stop at Slurm's TERM keeps the newest checkpoint; a resume drops later lines).
                self.log(metrics, progress.console)
                if saved:
                    self.save_checkpoint(step)
                progress.update(task, completed=step)
                # A stop commits its step before stopped_step is written: with async_save a
                # write of this step under way counts as not saved yet (save_and_wait joins it).
                if stop is not None and stop.after_step(step, last=last, saved=saved and self.writer is None,
                                                        save=self.save_and_wait):
                    window.close()   # stopped inside the window: its trace so far
                    return True
            window.close()
        self.wait_for_save()   # the last checkpoint committed before the run ends
        return False

    def log(self, metrics: dict, console) -> None:
        """The step's record to metrics.jsonl (and the logging backends); rank 0 prints a line."""
        self.metrics.log(metrics)
        if self.rank != 0:
            return
        m = lambda k: metrics.get(k, float("nan"))  # noqa: E731  (no update in warm-up)
        val = "".join(f"  {k} {v:.3f}" for k, v in metrics.items() if k.startswith("val/"))
        if "train_rollouts/rewards" not in metrics:
            console.print(f"step {metrics['step']}:{val}", highlight=False)
            return
        console.print(
            f"step {metrics['step']}:{val}  reward {m('train_rollouts/rewards'):+.3f}  "
            f"kl {m('train_rollouts/kl'):.4f}  "
            f"len {m('train_rollouts/response_lengths'):.1f}  "
            f"ended {m('train_rollouts/fraction_of_samples_properly_ended'):.2f}  "
            f"loss {m('train_optim/loss'):+.4f}  critic {m('train_optim/critic_loss'):.4f}  "
            f"{m('timers/step'):.2f}s", highlight=False)

    def close(self) -> None:
        self.collector.close()
        if self.store is not None:
            self.store.close()
        self.metrics.close()
        self.tracer.close()
        quiet.barrier(self.env.comm)
        if self.remote is not None:
            self.remote.close()
        for server in (self.critic, self.teacher):
            if server is not None:
                if self.rank == 0:
                    server.shutdown_critic()
                server.close()
        if self.rewards.judge is not None and self.rank == 0:
            self.rewards.judge.shutdown()   # the judge component, if the run has one
        self.pctx.destroy()


# -- construction ----------------------------------------------------------------------------
def _resume(rd: RunDir, policy: list, optimizer: ModelOptimizer) -> int:
    """The first step to run: 1, or the one after the newest complete checkpoint of this run
    (whose policy, optimizer and RNG state are loaded)."""
    latest = find_latest(rd.checkpoints("actor"))
    if latest is None:
        return 1
    common = load_checkpoint(latest, policy, optimizer)
    torch.set_rng_state(common["rng"])
    return int(common["step"]) + 1


def _open_store(rd: RunDir, start_step: int) -> RolloutStore:
    # Written in the background while the step goes on (flushed before each checkpoint).
    store = (RolloutStore.open(rd.rollouts, background=True) if rd.rollouts.exists()
             else RolloutStore.create(rd.rollouts, background=True))
    store.truncate_to(start_step)
    return store


def build_actor(run: RunConfig, rd: RunDir, env: DistEnv, pctx: ParallelContext) -> PPOActor:
    """Everything an actor rank needs, built once (collective): tokenised prompts, policy and
    optimizer (from the SFT checkpoint, or resumed from this run's newest checkpoint), the frozen
    reference in host memory, the engine on this rank's device, the critic client, the stores."""
    torch.manual_seed(run.seed)
    tokenizer = build_tokenizer(run.model)
    # Prompts are encoded as the SFT trainer formats its inputs (plain: [BOS] text; chat: the template).
    dataset = run_prompts(run, tokenizer)   # data.train_path or data.mixture
    prompts = dataset.token_arrays()
    # The model worker loads the init checkpoint (an iter_* folder, or a trainer's checkpoints
    # folder: its newest complete one), attaches LoRA, builds the optimizer and keeps the
    # reference policy (the initial policy: in host memory and swapped in, or LoRA's adapters off).
    # Its router stats stay off: the actor collects them over the whole step.
    worker = ModelWorker(run.model, pctx, seed=run.seed, reference=True, lr=run.ppo.actor_lr,
                         grad_clip=run.ppo.grad_clip,
                         batching=run_batching(run, "actor", run.ppo.train_micro_batch_size),
                         training=run.training, total_steps=actor_optimizer_steps(run), router_stats=False)
    policy, optimizer = worker.chunks, worker.optimizer
    start_step = _resume(rd, policy, optimizer)
    offload = TrainingStateOffload(optimizer.optimizer, policy) if run.switches.offload_optimizer else None
    engine = actor_engine(run, env, pctx)
    pctx.dp_comm  # noqa: B018  (collective the first time: every rank makes it now)
    critic = None
    if "critic" in run.components:   # PPO, or a reward model scores (reward-only critic)
        critic = CriticClient.from_run_config(run)
        critic.connect()   # waits (with backoff) while the critic starts; not part of the first step
    teacher: CriticClient | ColocatedTeacher | None = None
    if run.teacher_model is not None and run.switches.colocated_teacher:   # the ablation: no component
        teacher = ColocatedTeacher(run, pctx)
    elif "teacher" in run.components:   # on-policy distillation: the teacher scores every sample
        cs = run.critic_server
        assert run.run_dir is not None, "a job's run config knows its run directory"
        teacher = CriticClient.for_run_dir(run.run_dir, component="teacher", connect_timeout_s=cs.connect_timeout_s,
                                           request_timeout_s=cs.request_timeout_s)
        teacher.connect()
    tracer = Tracer(rd.root, "actor", env.rank, resume_from_step=start_step)
    if run.fault_tolerance.hang_timeout_s:   # from here on a phase must end within the timeout
        tracer.watchdog = Watchdog(run.fault_tolerance.hang_timeout_s, rd.logs / "actor", env.rank).start()
    tracer.device = device_hooks() if run.profiling.nvtx else None   # None on CPU
    # A resumed run redoes the steps after its checkpoint: their rollouts and metrics go.
    store = _open_store(rd, start_step) if env.rank == 0 else None
    metrics = MetricsLogger(run, rd.root, enabled=env.rank == 0)
    metrics.start_at(start_step)
    actor = PPOActor(run, rd, env, pctx, tokenizer=tokenizer, prompts=prompts, worker=worker, offload=offload,
                     engine=engine, critic=critic, tracer=tracer, store=store, metrics=metrics,
                     start_step=start_step,
                     rewards=Rewards(run, tokenizer, dataset.fields()), evalset=EvalSet.from_run(run, tokenizer),
                     remote=RemoteRollouts(run, rd, env.rank, tokenizer.pad_id) if "generator" in run.components
                     else None, teacher=teacher)
    actor.init_checkpoint = worker.init_checkpoint   # the base a LoRA checkpoint refers to
    return actor


def main(run_dir: str | Path) -> int:
    rd = RunDir(Path(run_dir))
    run = load_run_config(rd.config)
    env = init_distributed()
    stop = StopPoint(env.comm, rd)   # preemption: the ranks agree on a stop point after a step
    try:
        pctx = initialize_model_parallel(env, run.actor.tensor_parallel, run.actor.pipeline_parallel,
                                     run.actor.expert_parallel)
        actor = build_actor(run, rd, env, pctx)
        stop.resumed(actor.start_step, find_latest(rd.checkpoints("actor")))
        actor.run_loop(stop)
    except BaseException:
        stop.exit_if_stopped_by_term()   # a peer's stop at Slurm's TERM broke a collective: not a failure
        # The other ranks would wait forever in their next collective: print why, then take
        # the whole component down so the job fails at once.
        traceback.print_exc()
        sys.stderr.flush()
        env.comm.Abort(1)
    actor.close()
    return 0
