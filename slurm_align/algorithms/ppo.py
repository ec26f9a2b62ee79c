"""The actor loop of PPO and its family (every rank of the actor component runs `main`).

One step, as in ../shared/DESIGN.md ("Data flow of one PPO step") and as `PPOActor.step` reads:

    refit -> generate (prompt server, PP refolded into DP; each finished micro-batch goes to the
    critic at once) -> rebalance (one alltoall: each training DP rank gets its token-balanced
    shard as a RolloutBatch) -> logprobs / init_logprobs on the shard (the critic works
    meanwhile) -> critic_wait (values and rewards follow their samples along the same route) ->
    advantages (KL-penalised rewards, GAE, whitening by all-reduce) -> rank 0 gathers the step
    -> store -> train (the critic's update goes out first and overlaps it)

GRPO, RLOO, REINFORCE++ and rejection sampling run the same loop (algorithms/policy_gradient.py):
n_samples_per_prompt samples per prompt (a group, kept on one DP rank), no critic unless a
reward model scores, their own advantages and loss. A rule reward scores each micro-batch on the
rank that generated it; `eval:` scores greedy answers to held-out prompts (val/ metrics).

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
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import Progress

from slurm_align.algorithms.evaluation import EvalSet, evaluate, greedy_params
from slurm_align.algorithms.policy_gradient import PolicyUpdate, Rewards, combine_rewards, estimate_advantages
from slurm_align.algorithms.preemption import StopPoint
from slurm_align.algorithms.rollout_batch import RolloutBatch, all_reduce_sums, rollout_logprobs
from slurm_align.balance.replica import open_prompt_source, replica_batches
from slurm_align.config import RunConfig, load_run_config
from slurm_align.critic.client import CriticClient
from slurm_align.data.datasets import PromptDataset
from slurm_align.generation import Engine, engine_from_config
from slurm_align.generation.memory import TrainingStateOffload, generation_phase
from slurm_align.generation.params import SamplingParams, logprob_temperature
from slurm_align.generation.refit import refit_from_training
from slurm_align.models.checkpoint import find_latest, load_checkpoint, load_weights, save_checkpoint
from slurm_align.models.forward import forward_logprobs
from slurm_align.models.gpt import build_gpt
from slurm_align.models.packing import run_batching
from slurm_align.models.tokenizer import build_tokenizer
from slurm_align.models.weights import HostSwap
from slurm_align.parallel.bootstrap import DistEnv, init_distributed
from slurm_align.parallel.layout import ParallelContext, initialize_model_parallel
from slurm_align.profiling import phases as P
from slurm_align.profiling.metrics import MetricsLogger
from slurm_align.profiling.timers import Tracer
from slurm_align.rundir import RunDir
from slurm_align.store.rollouts import TOKEN_FIELDS, RolloutStore

STORED_SAMPLE_FIELDS = ("reward", "is_end", "rank")
"""Per-sample columns the rollout store keeps (its per-token ones are store.rollouts.TOKEN_FIELDS)."""


def sample_seed(run_seed: int, draws: int, index: int) -> int:
    """Per-sample sampling seed: the same sample draws the same tokens whoever generates it.
    `draws` keys the step (the number of steps before it)."""
    return (run_seed * 1_000_003 + draws * 100_003 + index) % (2**62)


def actor_engine(run: RunConfig, env: DistEnv, pctx: ParallelContext) -> Engine:
    """The generation engine on this rank's device (cuda:local_rank, or cpu) in the generation
    layout (TensorRT-LLM takes its TP from it). Collective: the layout's groups are built here."""
    with pctx.generation_layout(run.switches.refold) as layout:
        return engine_from_config(run, env.device, layout)


class PPOActor:
    """One actor rank's parts (made by `build_actor`) and the PPO loop over them."""

    def __init__(self, run: RunConfig, rd: RunDir, env: DistEnv, pctx: ParallelContext, *, tokenizer,
                 prompts: list[np.ndarray], policy: list, optimizer: torch.optim.Optimizer, reference: HostSwap,
                 offload: TrainingStateOffload | None, engine: Engine, critic: CriticClient | None, tracer: Tracer,
                 store: RolloutStore | None, metrics: MetricsLogger, start_step: int, rewards: Rewards, evalset: EvalSet | None):
        self.run, self.rd, self.env, self.pctx = run, rd, env, pctx
        self.rank = env.rank
        self.tokenizer, self.prompts = tokenizer, prompts
        self.policy, self.optimizer, self.reference, self.offload = policy, optimizer, reference, offload
        self.engine, self.critic, self.tracer, self.store, self.metrics = engine, critic, tracer, store, metrics
        self.start_step = start_step
        self.rewards, self.evalset = rewards, evalset
        self.update = PolicyUpdate(run, policy, optimizer, pctx,
                                   loss=run.spec.loss)
        self.pad_id = tokenizer.pad_id

    # -- phases ------------------------------------------------------------------------------
    def generate(self, step: int) -> tuple[RolloutBatch, list[tuple[RolloutBatch, Future | None]]]:
        """Refit, then generate this rank's share of the step's prompts, n_samples_per_prompt
        samples each (sample i * n + j of prompt slot i, group i: a group never splits); every
        finished micro-batch is scored by the rule reward here and goes to the critic at once.
        Returns this rank's rollouts (empty on ranks that do not request prompts) and the critic
        futures (None without a critic) with their micro-batches."""
        run = self.run
        k = run.rl.n_samples_per_prompt
        with self.tracer.span(P.REFIT, step):
            refit_from_training(self.engine, self.policy, self.pctx, refold=run.switches.refold)
        n = run.ppo.num_rollout_samples
        draws = step - 1   # the step's random draws are keyed by the number of steps before it
        rng = np.random.default_rng(run.seed + draws)
        order = rng.choice(len(self.prompts), size=n, replace=n > len(self.prompts)) if n != len(self.prompts) \
            else rng.permutation(n)
        # Dataset positions may repeat when n > dataset; the step-local index keeps samples unique.
        params = SamplingParams.from_config(run.generation, eos_id=self.tokenizer.eos_id, pad_id=self.pad_id)
        pending: list[tuple[RolloutBatch, Future]] = []
        with self.pctx.generation_layout(run.switches.refold) as layout:
            source = open_prompt_source(self.env.comm, layout, n, dynamic=run.switches.dynamic_prompts,
                                        tracer=self.tracer, step=step)
            for batch in replica_batches(layout, source, run.generation.prompt_batch_size):
                idx = [int(i) * k + j for i in batch for j in range(k)]
                prompts = [self.prompts[order[i // k]] for i in idx]
                with self.tracer.span(P.GENERATE, step):
                    out = self.engine.generate([torch.from_numpy(p) for p in prompts], params,
                                               seeds=[sample_seed(run.seed, draws, i) for i in idx])
                if not layout.is_requester:
                    continue    # the replica's other ranks ran the same batch in lock-step
                mb = RolloutBatch.from_sequences(prompts, out.responses(), self.pad_id, index=idx,
                                                 group=[i // k for i in idx], is_end=out.is_end.numpy(),
                                                 rank=[self.rank] * len(idx))
                mb.set_tokens("rollout_logprobs", rollout_logprobs(out, mb.max_response))
                rule = self.rewards.score(out.responses(), [int(order[i // k]) for i in idx])
                if rule is not None:
                    mb.set_samples("rule_reward", rule)
                if self.critic is None:
                    pending.append((mb, None))
                    continue
                fut = self.critic.infer_async(mb.tokens.numpy(), mb.seq_lengths.numpy(), step=step)
                if not run.switches.async_critic:
                    with self.tracer.span(P.CRITIC_WAIT, step):
                        fut.result()
                pending.append((mb, fut))
            source.close()
        return RolloutBatch.cat([mb for mb, _ in pending], self.pad_id), pending

    @torch.no_grad()
    def logprobs(self, shard: RolloutBatch, step: int) -> None:
        """Policy and reference log-probs of the shard's responses (every rank of the shard's
        model-parallel group gets them)."""
        vocab = self.run.model.vocab_size
        batching = run_batching(self.run, "actor", self.run.ppo.train_micro_batch_size)
        temperature = logprob_temperature(self.run.generation.temperature)   # the engine's, too

        def response_logprobs() -> torch.Tensor:
            logp = forward_logprobs(self.policy, self.pctx, shard.tokens, vocab, lengths=shard.seq_lengths,
                                    batching=batching, broadcast=True, temperature=temperature)
            return shard.from_positions(logp)

        with self.tracer.span(P.LOGPROBS, step):
            shard.set_tokens("logprobs", response_logprobs())
        with self.tracer.span(P.INIT_LOGPROBS, step):
            self.reference.swap()
            try:
                shard.set_tokens("ref_logprobs", response_logprobs())
            finally:
                self.reference.swap()

    def critic_results(self, pending: list[tuple[RolloutBatch, Future | None]], step: int) -> RolloutBatch:
        """This rank's micro-batches with the critic's values (per response token; 0 without a
        critic) and the reward: the reward model's score and the rule reward, weighted."""
        with self.tracer.span(P.CRITIC_WAIT, step):
            for mb, fut in pending:
                model_score = None
                if fut is None:
                    mb.set_tokens("values", torch.zeros_like(mb.mask))
                else:
                    values, model_score = fut.result()
                    mb.set_tokens("values", mb.from_positions(torch.from_numpy(values)))
                    model_score = torch.from_numpy(model_score)
                mb.set_samples("reward", combine_rewards(self.run, model_score, mb.samples.get("rule_reward")))
        return RolloutBatch.cat([mb for mb, _ in pending], self.pad_id)

    def gather_step(self, shard: RolloutBatch) -> RolloutBatch | None:
        """The whole step on rank 0 (for the store and the critic's update), in index order: one
        gather from the DP ranks' model-parallel leaders. None on the other ranks."""
        if self.pctx.tp_rank or self.pctx.pp_rank:
            return None
        parts = self.pctx.dp_comm.gather(shard.pack(), root=0)
        return None if parts is None else RolloutBatch.unpack(parts, self.pad_id).sorted_by("index")

    def critic_train(self, step_batch: RolloutBatch | None, step: int) -> Future | None:
        """Rank 0 sends the value-model update for the whole step; the actor trains meanwhile."""
        if step_batch is None or not self.run.critic_trains:
            return None
        b = step_batch
        return self.critic.train_async(b.tokens.numpy(), b.seq_lengths.numpy(), b.to_positions("returns").numpy(),
                                       b.to_positions("values").numpy(), b.position_mask().numpy(), step=step)

    def train(self, shard: RolloutBatch, step: int) -> dict:
        """The policy update on this DP rank's shard: epochs x optimizer batches (grads summed
        over DP); the clipped surrogate, or the SFT loss for rejection sampling."""
        return self.update.train(shard, step, self.tracer)

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out task score of the policy after `step` steps (refit, greedy answers); a
        span of step `step` (none for the initial policy, step 0, which is not a training step)."""
        run = self.run
        span = self.tracer.span(P.EVALUATE, step) if step > 0 else contextlib.nullcontext()
        with span, generation_phase(self.engine, self.offload, free_engine_after=False):
            refit_from_training(self.engine, self.policy, self.pctx, refold=run.switches.refold)
            with self.pctx.generation_layout(run.switches.refold) as layout:
                return evaluate(self.engine, layout, self.env.comm, self.evalset, greedy_params(run, self.tokenizer),
                                self.tokenizer, run.generation.prompt_batch_size * run.rl.n_samples_per_prompt)

    def rollout_metrics(self, shard: RolloutBatch) -> dict:
        """Means over the whole step (sums all-reduced over DP)."""
        mask = shard.mask
        s = all_reduce_sums({"reward": shard["reward"].double().sum(), "samples": shard.size,
                             "kl": ((shard["logprobs"] - shard["ref_logprobs"]) * mask).sum(),
                             "tokens": mask.sum(), "ended": shard["is_end"].sum()}, self.pctx.dp_group)
        return {"rewards": s["reward"] / s["samples"], "kl": s["kl"] / s["tokens"],
                "response_lengths": s["tokens"] / s["samples"],
                "fraction_of_samples_properly_ended": s["ended"] / s["samples"]}

    # -- the loop ----------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        run, pctx = self.run, self.pctx
        with generation_phase(self.engine, self.offload, free_engine_after=False):
            local, pending = self.generate(step)
        with self.tracer.span(P.REBALANCE, step):
            route = local.route(self.env.comm, pctx.dp_rank, pctx.dp_size, expected=run.rollouts_per_step)
            shard = local.moved(route)
        self.logprobs(shard, step)   # the critic works on the futures meanwhile
        results = self.critic_results(pending, step)
        with self.tracer.span(P.REBALANCE, step):
            shard.merge(results.moved(route, samples=["index", "reward"], per_token=["values"], with_tokens=False))
            advantage_metrics = estimate_advantages(run, shard, pctx.dp_group)
            step_batch = self.gather_step(shard)
        with self.tracer.span(P.STORE, step):
            if self.store is not None:
                self.store.append_step(step, step_batch.store_columns(TOKEN_FIELDS, STORED_SAMPLE_FIELDS))
        critic_future = self.critic_train(step_batch, step)
        warmup = run.critic_trains and step <= run.ppo.critic_warmup_steps   # only the critic trains
        optim = {} if warmup else self.train(shard, step)
        if critic_future is not None:
            with self.tracer.span(P.CRITIC_WAIT, step):
                optim["critic_loss"] = critic_future.result()
        # Named as NeMo-Aligner users know them: train_rollouts/, train_optim/, timers/.
        val = self.evaluate(step) if self.evalset is not None and self.evalset.due(run, step) else {}
        rollouts = {**self.rollout_metrics(shard), **advantage_metrics}
        return {"step": step, **val, **{f"train_rollouts/{k}": v for k, v in rollouts.items()},
                **{f"train_optim/{k}": v for k, v in optim.items()},
                **{f"timers/{k}": v for k, v in self.tracer.durations(step).items()}}

    def save_checkpoint(self, step: int) -> None:
        if self.store is not None:
            self.store.flush()   # no checkpoint ahead of the committed rollouts (resume leaves no gap)
        # The critic first: the actor's manifest, written last, commits the step for both roles.
        if self.rank == 0 and self.run.critic_trains:
            self.critic.save(str(self.rd.checkpoints("critic") / f"iter_{step:07d}.pt"))
        save_checkpoint(self.rd.checkpoints("actor"), step, self.policy, self.optimizer, {"algorithm": self.run.algorithm})

    def run_loop(self, stop: StopPoint | None = None) -> bool:
        """Run the remaining steps; True when `stop` ended the run early (after saving)."""
        run = self.run
        with Progress(disable=self.rank != 0, transient=False) as progress:
            task = progress.add_task(run.algorithm, total=run.ppo.num_steps, completed=self.start_step - 1)
            if self.evalset is not None and self.start_step == 1:
                self.log({"step": 0, **self.evaluate(0)}, progress.console)   # the initial policy
            for step in range(self.start_step, run.ppo.num_steps + 1):
                t0 = time.perf_counter()
                metrics = self.step(step)
                metrics["timers/step"] = time.perf_counter() - t0
                self.tracer.step_done(step)
                last = step == run.ppo.num_steps
                saved = bool((run.ppo.save_interval and step % run.ppo.save_interval == 0) or last)
                # Metrics before the checkpoint: a checkpoint then always has its step's metrics
                # (a stop at Slurm's TERM keeps the newest checkpoint; a resume drops later lines).
                self.log(metrics, progress.console)
                if saved:
                    self.save_checkpoint(step)
                progress.update(task, completed=step)
                if stop is not None and stop.after_step(step, last=last, saved=saved, save=self.save_checkpoint):
                    return True
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
            f"step {metrics['step']}:{val}  reward {m('train_rollouts/rewards'):+.3f}  kl {m('train_rollouts/kl'):.4f}  "
            f"len {m('train_rollouts/response_lengths'):.1f}  "
            f"ended {m('train_rollouts/fraction_of_samples_properly_ended'):.2f}  "
            f"loss {m('train_optim/loss'):+.4f}  critic {m('train_optim/critic_loss'):.4f}  "
            f"{m('timers/step'):.2f}s", highlight=False)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.metrics.close()
        self.tracer.close()
        self.env.comm.Barrier()
        if self.critic is not None:
            if self.rank == 0:
                self.critic.shutdown_critic()
            self.critic.close()
        self.pctx.destroy()


# -- construction ----------------------------------------------------------------------------
def _resume(rd: RunDir, policy: list, optimizer: torch.optim.Optimizer) -> int:
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
    dataset = PromptDataset(run.data.train_path, tokenizer, run.model.max_seq_len)
    prompts = dataset.token_arrays()
    policy = build_gpt(run.model, pctx, seed=run.seed)
    optimizer = torch.optim.AdamW([p for c in policy for p in c.parameters()], lr=run.ppo.actor_lr, weight_decay=0.0)
    if run.model.init_checkpoint is not None:
        # an iter_* folder, or a trainer's checkpoints folder (then its newest complete one)
        load_weights(find_latest(run.model.init_checkpoint) or run.model.init_checkpoint, policy)
    # The reference policy is the initial policy; it lives in host memory and is swapped in.
    reference = HostSwap(policy)
    start_step = _resume(rd, policy, optimizer)
    offload = TrainingStateOffload(optimizer, policy) if run.switches.offload_optimizer else None
    engine = actor_engine(run, env, pctx)
    pctx.dp_comm  # noqa: B018  (collective the first time: every rank makes it now)
    critic = None
    if "critic" in run.components:   # PPO, or a reward model scores (reward-only critic)
        critic = CriticClient.from_run_config(run)
        critic.connect()   # waits (with backoff) while the critic starts; not part of the first step
    tracer = Tracer(rd.root, "actor", env.rank, resume_from_step=start_step)
    # A resumed run redoes the steps after its checkpoint: their rollouts and metrics go.
    store = _open_store(rd, start_step) if env.rank == 0 else None
    metrics = MetricsLogger(run, rd.root, enabled=env.rank == 0)
    metrics.start_at(start_step)
    return PPOActor(run, rd, env, pctx, tokenizer=tokenizer, prompts=prompts, policy=policy, optimizer=optimizer,
                    reference=reference, offload=offload, engine=engine, critic=critic, tracer=tracer, store=store,
                    metrics=metrics, start_step=start_step,
                    rewards=Rewards(run, tokenizer, dataset.fields()), evalset=EvalSet.from_run(run, tokenizer))


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
