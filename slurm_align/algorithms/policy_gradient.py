"""What the PPO family does with a DP rank's share of one step's rollouts, between generation
and the next step: rewards, advantages (GAE for PPO; GRPO, RLOO, REINFORCE++ without a critic),
and the policy update in optimizer batches and epochs.

The actor loop (algorithms/ppo.py) calls, in order:

    Rewards.score(responses, row_ids)            rule reward on the generating rank, right after
                                                 generation
    combine_rewards(run, model_score, rule)      reward model score and rule reward, weighted
    estimate_advantages(run, shard, dp_group)    advantages (or rejection sampling's keep-best)
    PolicyUpdate(...).train(shard, step, tracer) epochs x optimizer batches (ModelWorker.train)

Groups (a prompt's n_samples_per_prompt samples) arrive whole on one DP rank (the rebalance keeps
them together), so group baselines need no communication; batch whitening (GAE, REINFORCE++)
and the loss normalisers are all-reduced over the DP ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from slurm_align.algorithms import advantages as A
from slurm_align.algorithms import rollout_correction
from slurm_align.algorithms.policy_loss import LossTerms
from slurm_align.algorithms.rejection_sampling import keep_best
from slurm_align.algorithms.rollout_batch import RolloutBatch, all_reduce_sums
from slurm_align.algorithms.rollout_losses import PolicyLoss, RolloutNLL
from slurm_align.config.run import RunConfig
from slurm_align.generation.params import logprob_temperature
from slurm_align.models.worker import ModelWorker
from slurm_align.profiling import phases as P
from slurm_align.rewards.rule import RuleReward


# -- rewards ---------------------------------------------------------------------------------
class Rewards:
    """The rule reward (RunConfig.reward.rule) of freshly generated samples, on the rank that
    generated them. `rows` are the prompt data rows (the rule gets their other fields)."""

    def __init__(self, run: RunConfig, tokenizer, rows: Sequence[dict[str, Any]]):
        self.rule = RuleReward.load(run.reward.rule) if run.reward.rule else None
        self.tokenizer, self.rows = tokenizer, rows
        self.judge = None   # RLAIF (reward.judge_weight): the judge component or the remote service
        if run.reward.judge_weight > 0:
            from slurm_align.judge.reward import JudgeReward
            self.judge = JudgeReward.for_run(run)

    def score(self, responses: list[torch.Tensor], row_ids: list[int]) -> np.ndarray | None:
        """Rule rewards [B] float32 for responses (token ids, EOS dropped by decode) to the
        prompts of data rows `row_ids`; None without a rule."""
        if self.rule is None:
            return None
        texts = [self.tokenizer.decode(r.tolist()) for r in responses]
        return np.asarray(self.rule.many(texts, [self.rows[i] for i in row_ids]), dtype=np.float32)

    def judge_score(self, responses: list[torch.Tensor], row_ids: list[int]) -> np.ndarray | None:
        """The judge's pointwise scores [B] float64 in [0, 1] of the responses to the prompts of
        data rows `row_ids` (their 'prompt' texts, as the rule reads them); None without a judge."""
        if self.judge is None:
            return None
        texts = [self.tokenizer.decode(r.tolist()) for r in responses]
        return self.judge.scores([self.rows[i]["prompt"] for i in row_ids], texts)


def teacher_score(mb, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """On-policy distillation's reward of each sample of micro-batch `mb`: sum over its response
    tokens y_t of log p_teacher(y_t) - log p_student(y_t), the student's log-prob being the one it
    sampled with ('rollout_logprobs'). Minus a one-sample estimate of the reverse KL
    KL(student || teacher) of the response: maximising it is minimising that KL (NeMo-RL's
    on-policy distillation). `teacher_logprobs`: [B, T] per response token."""
    diff = (teacher_logprobs.double() - mb["rollout_logprobs"].double()) * mb.mask.double()
    return diff.sum(1)


def combine_rewards(run: RunConfig, model_score: torch.Tensor | None, rule_score: torch.Tensor | None,
                    teacher: torch.Tensor | None = None, judge: torch.Tensor | None = None) -> torch.Tensor:
    """model_weight x reward model score + rule_weight x rule reward + teacher_weight x the
    teacher's term (teacher_score; on-policy distillation) + judge_weight x the judge's pointwise
    score (Rewards.judge_score; RLAIF), each when in use."""
    cfg = run.reward
    parts: list[torch.Tensor] = []
    if cfg.judge_weight > 0:
        assert judge is not None, "reward.judge_weight: the judge scores every sample"
        parts.append(cfg.judge_weight * judge.double())
    if run.teacher_model is not None:
        assert teacher is not None, "teacher_model: the teacher scores every sample"
        parts.append(cfg.teacher_weight * teacher.double())
    if cfg.use_model:
        assert model_score is not None, "reward.model: the critic scores every sample"
        parts.append(cfg.model_weight * model_score.double())
    if cfg.rule is not None or run.multi_turn:   # multi-turn: the environment's return
        assert rule_score is not None, "reward.rule (or the environment): every sample has a rule reward"
        parts.append(cfg.rule_weight * rule_score.double())
    # RunConfig refuses a run that has neither; summed from a float64 zero as sum() adds to 0
    return sum(parts, torch.zeros((), dtype=torch.float64)).float()


# -- advantages ------------------------------------------------------------------------------
def estimate_advantages(run: RunConfig, batch: RolloutBatch, dp_group) -> dict[str, float]:
    """Sets the per-token columns 'advantages' and 'returns' (and 'values' = 0 for the estimators
    without a critic) and the per-sample 'train' weight (0 for a group dropped by the equal-reward
    filter; best-of-n (loss 'sft', rejection sampling): 1 only for each group's best sample), and
    the rollout-correction weights (rollout_correction.WEIGHTS; not for the SFT loss). The
    estimator is the run's registered algorithm's (advantages.ESTIMATORS). Needs the columns
    reward, group, logprobs, ref_logprobs (values for GAE), rollout_logprobs for a correction.
    Returns metrics (summed over DP)."""
    spec = run.spec
    if spec.loss == "sft":
        s = all_reduce_sums(keep_best(batch), dp_group)
        return {"kept_rewards": s["kept_reward_sum"] / max(s["kept"], 1.0)}
    assert spec.estimator is not None, "config.algorithms: a loss 'policy' algorithm has an estimator"
    try:
        estimate = A.estimator(spec.estimator)
    except ValueError as e:
        raise ValueError(f"algorithm {run.algorithm!r}: {e}") from None
    mask, score = batch.mask, batch["reward"].float()
    adv, returns = estimate(run, batch, dp_group, run.ppo.kl_coef if run.kl_in_reward else 0.0)
    metrics = {}
    if not spec.value_model:
        batch.set_tokens("values", torch.zeros_like(mask))
    train = torch.ones(batch.size)
    if run.rl.filter_equal_reward_groups:
        drop = A.equal_reward_groups(score, batch["group"])
        train[drop] = 0.0
        groups_dropped = len(torch.unique(batch["group"][drop])) if batch.size else 0
        s = all_reduce_sums({"dropped": groups_dropped, "groups": len(torch.unique(batch["group"]))}, dp_group)
        metrics = {"dropped_groups": s["dropped"], "dropped_group_fraction": s["dropped"] / max(s["groups"], 1.0)}
    batch.set_tokens("advantages", adv)
    batch.set_tokens("returns", returns)
    batch.set_samples("train", train)
    metrics.update(rollout_correction.apply(run.rollout_correction, batch, dp_group))
    return metrics


# -- the update ------------------------------------------------------------------------------
def loss_terms(run: RunConfig) -> LossTerms:
    eps_low = run.rl.eps_low if run.rl.eps_low is not None else run.ppo.ratio_clip
    return LossTerms(eps_low=eps_low, eps_high=run.rl.eps_high if run.rl.eps_high is not None else eps_low,
                     agg=run.rl.loss_agg, kl_loss_coef=run.rl.kl_loss_coef, kl_estimator=run.rl.kl_estimator,
                     entropy_coef=run.ppo.entropy_coef)


def optimizer_batches(size: int, run: RunConfig, step: int, epoch: int) -> list[np.ndarray]:
    """This rank's rows of each optimizer step of one epoch: the shard split into
    rollouts_per_step / global_batch_size parts (every DP rank holds the same count, so part j
    of every rank makes global batch j). Later epochs reshuffle (same on every rank of a
    model-parallel group: a function of seed, step, epoch)."""
    gbs = run.ppo.global_batch_size or run.rollouts_per_step
    parts = max(run.rollouts_per_step // gbs, 1)
    order = np.arange(size)
    if epoch > 0:
        order = np.random.default_rng([run.seed, step, epoch]).permutation(size)
    return np.array_split(order, parts)


def actor_optimizer_steps(run: RunConfig) -> int:
    """The policy's optimizer steps over the whole run (where its LR decay ends by default)."""
    gbs = run.ppo.global_batch_size or run.rollouts_per_step
    return run.ppo.num_steps * run.ppo.epochs * max(run.rollouts_per_step // gbs, 1)


class PolicyUpdate:
    """The actor's update of one step on this DP rank's shard: ppo.epochs passes, each split
    into optimizer steps of ppo.global_batch_size rollouts (NeMo-Aligner's mini-batches), each
    one step of the model worker (models/worker.py: micro-batches, the global normaliser, the
    forward/backward over TP/PP, gradients summed over DP, the optimizer step).

    Both losses (algorithms/rollout_losses.py) count the tokens of responses that ended (is_end) and were
    kept ('train' weight). loss 'policy': the run's registered policy loss (RunConfig.loss;
    default ppo_clip, the clipped surrogate + KL loss term, entropy bonus of policy_loss.py) at
    the sampling temperature; loss 'sft': negative log-likelihood (rejection sampling)."""

    def __init__(self, run: RunConfig, worker: ModelWorker, *, loss: Literal["policy", "sft"] = "policy"):
        self.run, self.worker, self.pctx, self.loss = run, worker, worker.pctx, loss
        self.terms = loss_terms(run)
        self.objective: RolloutNLL
        if loss == "policy":
            spec, options = run.loss_spec_and_options()
            # The policy is scored at the sampling temperature, as pi_old and the engine's log-probs.
            self.objective = PolicyLoss(options, run.model, fn=spec.load(), terms=self.terms,
                                        temperature=logprob_temperature(run.generation.temperature))
        else:
            self.objective = RolloutNLL(None, run.model)

    def train(self, shard: RolloutBatch, step: int, tracer) -> dict[str, float]:
        run = self.run
        # responses cut at max_new_tokens teach nothing
        shard.set_samples("weight", shard["is_end"].float() * shard["train"])
        totals = dict.fromkeys(self.objective.sum_keys, 0.0)
        norms, lrs = [], []
        with tracer.span(P.TRAIN, step):
            for epoch in range(run.ppo.epochs):
                for rows in optimizer_batches(shard.size, run, step, epoch):
                    m = self.worker.train(shard, rows.tolist(), self.objective)
                    norms.append(m["grad_norm"])
                    lrs.append(m["lr"])
                    for k in totals:
                        totals[k] += m[k]
        tokens = max(totals["tokens"], 1.0)
        out = {"loss": totals["loss"] / len(norms), "grad_norm": float(np.mean(norms)), "lr": lrs[0],
               "optimizer_steps": float(len(norms)), **self.worker.optimizer.metrics()}   # fp16: loss scale
        if self.loss == "policy":
            out.update(ppo_ratio=totals["ratio"] / tokens, ppo_ratio_clamped=totals["clipped"] / tokens)
            if self.terms.kl_loss_coef > 0:
                out["kl_loss"] = totals["kl"] / tokens
        return out
