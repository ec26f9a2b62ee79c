"""The PPO actor loop (every rank of the actor component runs `main`).

One step, as in ../shared/DESIGN.md ("Data flow of one PPO step"):

    refit -> generate (prompt server, PP refolded to DP; each finished micro-batch goes to the
    critic at once) -> logprobs / init_logprobs (while the critic works) -> critic_wait ->
    rebalance -> rewards + GAE + whitening -> store -> train (the critic trains meanwhile)

Every phase is a span in RUN_DIR/traces.zarr. Rollouts go to RUN_DIR/rollouts.zarr (rank 0).
Shapes: per-token tensors are [B, T] over response tokens; the critic sees whole sequences,
where the value of response token t sits at sequence position prompt_len + t - 1 (the state
before the token was generated), as in NeMo-Aligner.
"""

from __future__ import annotations

import json
import sys
import traceback
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from slurm_align.algorithms import ppo_math
from slurm_align.algorithms.losses import next_token_logprobs, token_logprobs
from slurm_align.config import RunConfig, load_run_config
from slurm_align.profiling import phases as P
from slurm_align.profiling.timers import Tracer
from slurm_align.rundir import RunDir, write_atomic


@dataclass
class Sample:
    """One rollout; per-token arrays are over response tokens."""

    index: int                    # prompt index in the dataset (unique within a step)
    prompt: np.ndarray
    response: np.ndarray
    is_end: bool
    rank: int                     # actor rank that generated it
    values: np.ndarray | None = None
    reward: float | None = None
    logprobs: np.ndarray | None = None
    ref_logprobs: np.ndarray | None = None


def sample_seed(run_seed: int, step: int, index: int) -> int:
    """Per-sample sampling seed: the same sample draws the same tokens whoever generates it."""
    return (run_seed * 1_000_003 + step * 100_003 + index) % (2**62)


def pad_sequences(samples: list[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+response tokens [B, L], prompt lengths [B], response lengths [B]."""
    plen = torch.tensor([len(s.prompt) for s in samples], dtype=torch.int64)
    rlen = torch.tensor([len(s.response) for s in samples], dtype=torch.int64)
    width = int((plen + rlen).max())
    tokens = torch.full((len(samples), width), pad_id, dtype=torch.int64)
    for i, s in enumerate(samples):
        seq = np.concatenate([s.prompt, s.response])
        tokens[i, : len(seq)] = torch.from_numpy(seq.astype(np.int64))
    return tokens, plen, rlen


def response_positions(plen: torch.Tensor, rlen: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the position whose output predicts response token t ([B, T]) and the mask."""
    t = torch.arange(T).unsqueeze(0)
    mask = (t < rlen.unsqueeze(1)).float()
    pos = (plen.unsqueeze(1) - 1 + t).clamp(min=0)
    return pos, mask


def response_logprobs(token_logp: torch.Tensor, plen: torch.Tensor, rlen: torch.Tensor, T: int) -> torch.Tensor:
    """log p(response token t) [B, T] from next-token log-probs [B, L-1] (0 past each end)."""
    pos, mask = response_positions(plen, rlen, T)
    # Index j of token_logp is token j+1's log-prob; positions past a sequence's end are masked.
    return token_logp.gather(1, pos.clamp(max=token_logp.shape[1] - 1)) * mask


def to_response_layout(per_position: np.ndarray, plen: int, rlen: int) -> np.ndarray:
    """Critic values over sequence positions -> one per response token."""
    return per_position[plen - 1: plen - 1 + rlen].astype(np.float32)


class PPOActor:
    """State of one actor rank: models, optimizer, engine, critic client, stores."""

    def __init__(self, run: RunConfig, run_dir: Path):
        from slurm_align.critic.client import CriticClient
        from slurm_align.data.jsonl import PROMPT_KEYS, read_jsonl
        from slurm_align.parallel.bootstrap import init_distributed
        from slurm_align.parallel.layout import initialize_model_parallel
        from slurm_align.generation import engine_from_config
        from slurm_align.generation.memory import TrainingStateOffload
        from slurm_align.models.gpt import build_gpt
        from slurm_align.models.tokenizer import build_tokenizer
        from slurm_align.models.checkpoint import find_latest, load_weights
        from slurm_align.models.weights import HostSwap

        self.run, self.rd = run, RunDir(run_dir)
        self.env = init_distributed()
        self.pctx = initialize_model_parallel(self.env, run.actor.tensor_parallel, run.actor.pipeline_parallel)
        self.rank = self.env.rank
        torch.manual_seed(run.seed)
        self.tokenizer = build_tokenizer(run.model)
        # Prompts are BOS + text, as the SFT trainer formats its inputs.
        self.prompts = [np.asarray([self.tokenizer.bos_id, *self.tokenizer.encode(row["prompt"])], dtype=np.int64)
                        for row in read_jsonl(run.data.train_path, PROMPT_KEYS, "prompts")]
        self.policy = build_gpt(run.model, self.pctx, seed=run.seed)
        self.optimizer = torch.optim.AdamW([p for c in self.policy for p in c.parameters()],
                                           lr=run.ppo.actor_lr, weight_decay=0.0)
        if run.model.init_checkpoint is not None:
            # an iter_* folder, or a trainer's checkpoints folder (then its newest complete one)
            load_weights(find_latest(run.model.init_checkpoint) or run.model.init_checkpoint, self.policy)
        # The reference policy is the initial policy; it lives in host memory and is swapped in.
        self.reference = HostSwap(self.policy)
        self.start_step = self._resume()
        self.offload = TrainingStateOffload(self.optimizer, self.policy) if run.switches.offload_optimizer else None
        self.engine = engine_from_config(run)
        self.critic = CriticClient.from_run_config(run)
        self.critic.connect()   # waits (with backoff) while the critic starts; not part of step 0
        self.tracer = Tracer(self.rd.root, "actor", self.rank, resume_from_step=self.start_step)
        self.store = None
        if self.rank == 0:
            from slurm_align.store.rollouts import RolloutStore
            path = self.rd.rollouts
            self.store = RolloutStore.open(path) if path.exists() else RolloutStore.create(path)
            # A resumed run redoes the steps after its checkpoint: drop their rollouts and metrics.
            self.store.truncate_to(self.start_step)
        self.metrics_path = self.rd.root / "metrics.jsonl"
        if self.rank == 0 and self.metrics_path.exists():
            kept = [line for line in self.metrics_path.read_text().splitlines()
                    if line and json.loads(line)["step"] < self.start_step]
            write_atomic(self.metrics_path, "".join(f"{line}\n" for line in kept))

    # -- checkpoints -------------------------------------------------------------------------
    def _resume(self) -> int:
        """Continue after the newest complete checkpoint of this run (policy, optimizer, RNG)."""
        from slurm_align.models.checkpoint import find_latest, load_checkpoint
        latest = find_latest(self.rd.checkpoints("actor"))
        if latest is None:
            return 0
        common = load_checkpoint(latest, self.policy, self.optimizer)
        torch.set_rng_state(common["rng"])
        return int(common["step"]) + 1

    def save_checkpoint(self, step: int) -> None:
        from slurm_align.models.checkpoint import save_checkpoint
        save_checkpoint(self.rd.checkpoints("actor"), step, self.policy, self.optimizer, {"algorithm": "ppo"})
        if self.rank == 0:
            self.critic.save(str(self.rd.checkpoints("critic") / f"iter_{step:07d}.pt"))

    # -- phases ------------------------------------------------------------------------------
    def generate(self, step: int) -> tuple[list[Sample], list[tuple[list[int], Future]]]:
        from slurm_align.balance.replica import open_prompt_source, replica_batches
        from slurm_align.generation.params import SamplingParams
        from slurm_align.generation.refit import refit_from_training

        run = self.run
        with self.tracer.span(P.REFIT, step):
            refit_from_training(self.engine, self.policy, self.pctx, refold=run.switches.refold)
        n = run.ppo.num_rollout_samples
        rng = np.random.default_rng(run.seed + step)
        order = rng.choice(len(self.prompts), size=n, replace=n > len(self.prompts)) if n != len(self.prompts) \
            else rng.permutation(n)
        # Dataset positions may repeat when n > dataset; the step-local index keeps samples unique.
        params = SamplingParams.from_config(run.generation, eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id)
        samples: list[Sample] = []
        pending: list[tuple[list[int], Future]] = []
        with self.pctx.generation_layout(run.switches.refold) as layout:
            source = open_prompt_source(self.env.comm, layout, n, dynamic=run.switches.dynamic_prompts,
                                        tracer=self.tracer, step=step)
            for batch in replica_batches(layout, source, run.generation.prompt_batch_size):
                idx = [int(i) for i in batch]
                with self.tracer.span(P.GENERATE, step):
                    out = self.engine.generate([torch.from_numpy(self.prompts[order[i]]) for i in idx], params,
                                               seeds=[sample_seed(run.seed, step, i) for i in idx])
                if not layout.is_requester:
                    continue    # the replica's other ranks ran the same batch in lock-step
                new = [Sample(i, self.prompts[order[i]], r.numpy().astype(np.int64), bool(e), self.rank)
                       for i, r, e in zip(idx, out.responses(), out.is_end.tolist())]
                samples += new
                tokens, plen, rlen = pad_sequences(new, self.tokenizer.pad_id)
                fut = self.critic.infer_async(tokens.numpy(), (plen + rlen).numpy(), step=step)
                if not run.switches.async_critic:
                    with self.tracer.span(P.CRITIC_WAIT, step):
                        fut.result()
                pending.append((idx, fut))
            source.close()
        return samples, pending

    def gather(self, samples: list[Sample]) -> list[Sample]:
        """Every rank gets every rollout of the step, ordered by index."""
        everything = [s for part in self.env.comm.allgather(samples) for s in part]
        everything.sort(key=lambda s: s.index)
        indices = [s.index for s in everything]
        if len(set(indices)) != len(indices) or len(indices) != self.run.ppo.num_rollout_samples:
            raise RuntimeError(f"rollout gather: got {len(indices)} samples ({len(set(indices))} distinct) for "
                               f"{self.run.ppo.num_rollout_samples} prompts: a sample was lost or duplicated")
        return everything

    def training_shard(self, samples: list[Sample]) -> list[Sample]:
        """This DP rank's equal share, balanced by token count (same plan on every rank)."""
        from slurm_align.balance.rebalance import plan_rebalance
        dp = self.pctx.dp_size
        if dp == 1:
            return samples
        lengths = [len(s.prompt) + len(s.response) for s in samples]
        # As if all samples sat on one source rank: the plan spreads them over dp ranks.
        dest = plan_rebalance([len(samples)] + [0] * (dp - 1), [lengths] + [[]] * (dp - 1))[0]
        return [s for s, d in zip(samples, dest) if d == self.pctx.dp_rank]

    @torch.no_grad()
    def logprobs(self, shard: list[Sample], step: int) -> None:
        from slurm_align.models.forward import forward_logits
        tokens, plen, rlen = pad_sequences(shard, self.tokenizer.pad_id)
        T = int(rlen.max())
        mbs = self.run.ppo.train_micro_batch_size
        with self.tracer.span(P.LOGPROBS, step):
            logits = forward_logits(self.policy, self.pctx, tokens, self.run.model.vocab_size,
                                    micro_batch_size=mbs, broadcast=True)
            lp = response_logprobs(next_token_logprobs(logits, tokens), plen, rlen, T)
        with self.tracer.span(P.INIT_LOGPROBS, step):
            self.reference.swap()
            try:
                logits = forward_logits(self.policy, self.pctx, tokens, self.run.model.vocab_size,
                                        micro_batch_size=mbs, broadcast=True)
            finally:
                self.reference.swap()
            ref = response_logprobs(next_token_logprobs(logits, tokens), plen, rlen, T)
        for i, s in enumerate(shard):
            s.logprobs = lp[i, : len(s.response)].numpy()
            s.ref_logprobs = ref[i, : len(s.response)].numpy()

    def critic_results(self, samples: list[Sample], pending, step: int) -> None:
        """Wait for this rank's critic futures, then share every result with every rank."""
        mine = {}
        with self.tracer.span(P.CRITIC_WAIT, step):
            by_index = {s.index: s for s in samples}
            for idx, fut in pending:
                values, rewards = fut.result()
                for row, i in enumerate(idx):
                    s = by_index[i]
                    mine[i] = (to_response_layout(values[row], len(s.prompt), len(s.response)), float(rewards[row]))
        return mine

    def finish_batch(self, samples: list[Sample], critic: dict, lp: dict) -> dict[str, torch.Tensor]:
        """Rewards with the KL penalty, GAE, whitened advantages over the whole (global) batch."""
        run = self.run
        for s in samples:
            s.values, s.reward = critic[s.index]
            s.logprobs, s.ref_logprobs = lp[s.index]
        B, T = len(samples), max(len(s.response) for s in samples)
        mask = torch.zeros(B, T)
        logp, ref, values = torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B, T)
        for i, s in enumerate(samples):
            r = len(s.response)
            mask[i, :r] = 1
            logp[i, :r] = torch.from_numpy(s.logprobs)
            ref[i, :r] = torch.from_numpy(s.ref_logprobs)
            values[i, :r] = torch.from_numpy(s.values)
        score = torch.tensor([s.reward for s in samples])
        rewards = ppo_math.kl_penalized_rewards(score, logp, ref, mask, run.ppo.kl_coef)
        adv, returns = ppo_math.gae(rewards, values, mask, run.ppo.gamma, run.ppo.lam)
        # Every rank holds the whole batch, so whitening over it is whitening across all DP ranks.
        adv = ppo_math.masked_whiten(adv, mask)
        return {"mask": mask, "logp": logp, "ref": ref, "values": values, "advantages": adv,
                "returns": returns, "score": score}

    def write_rollouts(self, step: int, samples: list[Sample], batch: dict) -> None:
        if self.store is None:
            return
        lens = [len(s.response) for s in samples]
        cut = lambda t: [t[i, :n].numpy() for i, n in enumerate(lens)]  # noqa: E731  ragged, one per sample
        self.store.append_step(step, {
            "prompt_tokens": [s.prompt for s in samples], "response_tokens": [s.response for s in samples],
            "logprobs": cut(batch["logp"]), "ref_logprobs": cut(batch["ref"]), "values": cut(batch["values"]),
            "advantages": cut(batch["advantages"]), "returns": cut(batch["returns"]),
            "reward": batch["score"].numpy(), "is_end": np.array([s.is_end for s in samples]),
            "rank": np.array([s.rank for s in samples]),
        })

    def critic_train(self, samples: list[Sample], batch: dict, step: int) -> Future | None:
        """Rank 0 sends the value-model update for the whole batch; the actor trains meanwhile."""
        if self.rank != 0:
            return None
        tokens, plen, rlen = pad_sequences(samples, self.tokenizer.pad_id)
        B, L = tokens.shape
        full = {k: np.zeros((B, L), dtype=np.float32) for k in ("returns", "values", "mask")}
        for i, s in enumerate(samples):
            a, r = int(plen[i]) - 1, len(s.response)
            full["returns"][i, a:a + r] = batch["returns"][i, :r].numpy()
            full["values"][i, a:a + r] = batch["values"][i, :r].numpy()
            full["mask"][i, a:a + r] = 1.0
        return self.critic.train_async(tokens.numpy(), (plen + rlen).numpy(), full["returns"], full["values"],
                                       full["mask"], step=step)

    def train(self, samples: list[Sample], shard_ids: set[int], batch: dict, step: int) -> dict:
        """One PPO update of the policy on this DP rank's shard (grads summed over DP)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        from slurm_align.algorithms.trainer import reduce_gradients
        from slurm_align.models.forward import run_schedule

        run = self.run
        rows = [i for i, s in enumerate(samples) if s.index in shard_ids]
        ended = torch.tensor([s.is_end for s in samples])
        # The loss is a mean over all ended tokens of the GLOBAL batch: each rank adds its share.
        token_count = float((batch["mask"] * ended[:, None]).sum())
        shard = [samples[i] for i in rows]
        tokens, plen, rlen = pad_sequences(shard, self.tokenizer.pad_id)
        T = batch["mask"].shape[1]
        mbs = run.ppo.train_micro_batch_size
        vocab = run.model.vocab_size
        micro = []
        for a in range(0, len(rows), mbs):
            sel = list(range(a, min(a + mbs, len(rows))))
            g = [rows[i] for i in sel]
            micro.append({"tokens": tokens[sel], "plen": plen[sel], "rlen": rlen[sel],
                          "old": batch["logp"][g], "adv": batch["advantages"][g], "mask": batch["mask"][g],
                          "is_end": ended[g]})
        # Pipeline buffers need equal micro-batch shapes: pad the last one with masked rows.
        last = micro[-1]
        short = mbs - last["tokens"].shape[0]
        if short:
            micro[-1] = {k: torch.cat([v, v[-1:].expand(short, *v.shape[1:]) if k not in ("mask", "is_end")
                                       else torch.zeros(short, *v.shape[1:], dtype=v.dtype)]) for k, v in last.items()}
        stats = []

        def loss_fn(output, mb):
            logp = response_logprobs(token_logprobs(output, mb["tokens"], vocab), mb["plen"], mb["rlen"], T)
            entropy = None
            if run.ppo.entropy_coef > 0:
                logits = gather_from_tensor_model_parallel_region(output)[..., :vocab]
                pos, _ = response_positions(mb["plen"], mb["rlen"], T)
                lp_all = torch.log_softmax(logits.float(), -1).gather(
                    1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
                entropy = -(lp_all.exp() * lp_all).sum(-1)
            loss, st = ppo_math.ppo_policy_loss(logp, mb["old"], mb["adv"], mb["mask"], mb["is_end"],
                                                run.ppo.ratio_clip, entropy, run.ppo.entropy_coef, token_count)
            stats.append((st, float((mb["mask"] * mb["is_end"][:, None]).sum())))
            return loss, {"loss": loss.detach()}

        with self.tracer.span(P.TRAIN, step):
            for c in self.policy:
                c.train()
            self.optimizer.zero_grad(set_to_none=True)
            run_schedule(self.policy, micro, loss_fn, forward_only=False)
            grad_norm = reduce_gradients([p for c in self.policy for p in c.parameters()], self.pctx,
                                         run.ppo.grad_clip)
            self.optimizer.step()
        # Sums over this rank's micro-batches; only last-stage ranks of TP rank 0 computed a loss
        # (one per DP rank): add their shares, weight the ratio statistics by ended tokens.
        mine = None
        if stats and self.pctx.tp_rank == 0:
            mine = [(st.loss, st.ppo_ratio * n, st.ppo_ratio_clamped * n, n) for st, n in stats]
        parts = [x for part in self.env.comm.allgather(mine) if part for x in part]
        loss, ratio, clamped, tokens = (sum(col) for col in zip(*parts)) if parts else (0.0, 0.0, 0.0, 0.0)
        tokens = max(tokens, 1.0)
        return {"loss": loss, "ppo_ratio": ratio / tokens, "ppo_ratio_clamped": clamped / tokens,
                "grad_norm": grad_norm, "lr": run.ppo.actor_lr}

    # -- the loop ----------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        from slurm_align.generation.memory import generation_phase
        run = self.run
        with generation_phase(self.engine, self.offload, free_engine_after=False):
            local, pending = self.generate(step)
        with self.tracer.span(P.REBALANCE, step):
            samples = self.gather(local)
            shard = self.training_shard(samples)
        self.logprobs(shard, step)   # the critic works on the futures meanwhile
        mine = self.critic_results(local, pending, step)
        with self.tracer.span(P.REBALANCE, step):
            critic = {k: v for part in self.env.comm.allgather(mine) for k, v in part.items()}
            # Only one rank of each model-parallel group contributes log-probs (they agree).
            lp_mine = {s.index: (s.logprobs, s.ref_logprobs) for s in shard} \
                if self.pctx.tp_rank == 0 and self.pctx.pp_rank == 0 else {}
            lp = {k: v for part in self.env.comm.allgather(lp_mine) for k, v in part.items()}
            batch = self.finish_batch(samples, critic, lp)
        with self.tracer.span(P.STORE, step):
            self.write_rollouts(step, samples, batch)
        critic_future = self.critic_train(samples, batch, step)
        optim = {}
        if step >= run.ppo.critic_warmup_steps:
            optim = self.train(samples, {s.index for s in shard}, batch, step)
        if critic_future is not None:
            with self.tracer.span(P.CRITIC_WAIT, step):
                optim["critic_loss"] = critic_future.result()
        mask = batch["mask"]
        rollouts = {
            "rewards": float(batch["score"].mean()),
            "kl": float(((batch["logp"] - batch["ref"]) * mask).sum() / mask.sum()),
            "response_lengths": float(mask.sum(1).mean()),
            "fraction_of_samples_properly_ended": float(np.mean([s.is_end for s in samples])),
        }
        # Named as NeMo-Aligner users know them: train_rollouts/, train_optim/, timers/.
        return {"step": step, **{f"train_rollouts/{k}": v for k, v in rollouts.items()},
                **{f"train_optim/{k}": v for k, v in optim.items()},
                **{f"timers/{k}": v for k, v in self.tracer.durations(step).items()}}

    def run_loop(self) -> None:
        from rich.progress import Progress
        run = self.run
        steps = range(self.start_step, run.ppo.num_steps)
        with Progress(disable=self.rank != 0, transient=False) as progress:
            task = progress.add_task("PPO", total=run.ppo.num_steps, completed=self.start_step)
            for step in steps:
                t0 = time.perf_counter()
                metrics = self.step(step)
                metrics["timers/step"] = time.perf_counter() - t0
                self.tracer.step_done(step)
                last = step == run.ppo.num_steps - 1
                if (run.ppo.save_interval and (step + 1) % run.ppo.save_interval == 0) or last:
                    self.save_checkpoint(step)
                if self.rank == 0:
                    with open(self.metrics_path, "a") as f:
                        f.write(json.dumps(metrics) + "\n")
                    m = lambda k: metrics.get(k, float("nan"))  # noqa: E731  (no update in warm-up)
                    progress.console.print(
                        f"step {step}: reward {m('train_rollouts/rewards'):+.3f}  kl {m('train_rollouts/kl'):.4f}  "
                        f"len {m('train_rollouts/response_lengths'):.1f}  "
                        f"ended {m('train_rollouts/fraction_of_samples_properly_ended'):.2f}  "
                        f"loss {m('train_optim/loss'):+.4f}  critic {m('train_optim/critic_loss'):.4f}  "
                        f"{m('timers/step'):.2f}s", highlight=False)
                progress.update(task, completed=step + 1)

    def close(self) -> None:
        self.tracer.close()
        self.env.comm.Barrier()
        if self.rank == 0:
            self.critic.shutdown_critic()
        self.critic.close()
        self.pctx.destroy()


def main(run_dir: str | Path) -> int:
    run_dir = Path(run_dir)
    run = load_run_config(RunDir(run_dir).config)
    actor = PPOActor(run, run_dir)
    try:
        actor.run_loop()
    except BaseException:
        # The other ranks would wait forever in their next collective: print why, then take
        # the whole component down so the job fails at once.
        traceback.print_exc()
        sys.stderr.flush()
        actor.env.comm.Abort(1)
    actor.close()
    return 0
