"""The RL actor's update (policy_gradient.PolicyUpdate) trains through the one model worker's
step (models/worker.py) with the registered rollout losses (algorithms/rollout_losses.py). On a fixed batch
and a real megatron GPT in a one-rank world, with SGD at lr 1 (the weights move by exactly the
gradient), the weights and metrics after the update equal, bit for bit in fp32, those of the
actor's own loop as it was before the worker (246a4ba's PolicyUpdate._optimizer_step, kept here
as `update_as_before`): same micro-batches, same normaliser, same loss, same steps. The run has
two epochs of two optimizer steps, a KL loss term, an entropy bonus, a sample cut at
max_new_tokens and one dropped by the 'train' weight; rejection sampling's SFT loss likewise.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from slurm_align.algorithms.policy_gradient import PolicyUpdate, loss_terms, optimizer_batches
from slurm_align.algorithms.policy_loss import aggregate, clipped_policy_loss, denominator
from slurm_align.algorithms.rollout_batch import RolloutBatch
from slurm_align.config.run import RunConfig
from slurm_align.data.positions import gather_response
from slurm_align.generation.params import logprob_temperature
from slurm_align.models.forward import per_sequence, run_schedule, sequence_token_logprobs
from slurm_align.models.gpt import build_gpt
from slurm_align.models.optimizer import build_optimizer
from slurm_align.models.packing import run_batching
from slurm_align.models.weights import full_state_dict
from slurm_align.models.worker import ModelWorker
from tests.support.single_rank import single_rank_world

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=260, max_seq_len=64)


class NoTracer:
    def span(self, *args):
        return contextlib.nullcontext()


def make_run(loss: str) -> RunConfig:
    algorithm = "grpo" if loss == "policy" else "rejection_sampling"
    return RunConfig(algorithm=algorithm, model=MODEL, rl={"n_samples_per_prompt": 2, "kl_loss_coef": 0.1},
                     reward={"rule": "slurm_align.rewards.arithmetic:exact_answer"},
                     generation={"temperature": 0.7},
                     ppo={"num_rollout_samples": 4, "grad_clip": 0.0, "train_micro_batch_size": 3, "epochs": 2,
                          "global_batch_size": 4, "entropy_coef": 0.01})


def rollouts() -> RolloutBatch:
    """8 samples of long-tailed lengths; the last cut at max_new_tokens (is_end False), sample 2
    dropped (train 0); pi_old, the reference and advantages drawn at random."""
    g = torch.Generator().manual_seed(5)
    plen, rlen = [3, 5, 2, 4, 6, 3, 2, 5], [20, 2, 9, 1, 30, 4, 12, 3]
    b = RolloutBatch.from_sequences([torch.randint(1, 250, (p,), generator=g) for p in plen],
                                    [torch.randint(1, 250, (r,), generator=g) for r in rlen], pad_id=0,
                                    index=list(range(8)), group=[i // 2 for i in range(8)],
                                    is_end=[True] * 7 + [False])
    T = b.max_response
    b.set_tokens("logprobs", -torch.rand(8, T, generator=g) * 3 * b.mask)
    b.set_tokens("ref_logprobs", -torch.rand(8, T, generator=g) * 3 * b.mask)
    b.set_tokens("advantages", torch.randn(8, T, generator=g) * b.mask)
    b.set_samples("train", torch.tensor([1.0, 1, 0, 1, 1, 1, 1, 1]))
    return b


def policy_and_sgd(run: RunConfig, pctx):
    policy = build_gpt(run.model, pctx, seed=31)
    opt = build_optimizer([p for c in policy for p in c.parameters()], pctx, run.training, lr=1.0)
    opt.optimizer = torch.optim.SGD(opt.params, lr=1.0)   # weights move by exactly the gradient
    return policy, opt


def update_as_before(run: RunConfig, policy, optimizer, pctx, shard: RolloutBatch, loss: str) -> dict:
    """The actor's update loop before the model worker (246a4ba), verbatim but for the names."""
    terms = loss_terms(run)
    agg = "token-mean" if loss == "sft" else terms.agg
    temperature = 1.0 if loss == "sft" else logprob_temperature(run.generation.temperature)
    batching = run_batching(run, "actor", run.ppo.train_micro_batch_size)
    vocab = run.model.vocab_size
    totals = {"loss": 0.0, "ratio": 0.0, "clipped": 0.0, "kl": 0.0, "tokens": 0.0}
    norms = []
    for c in policy:
        c.train()

    def entropy_of(output, mb, T):
        logits = gather_from_tensor_model_parallel_region(output)[..., :vocab]
        lp_all = torch.log_softmax(logits.float() / temperature, -1)
        return gather_response(per_sequence(-(lp_all.exp() * lp_all).sum(-1), mb), mb["prompt_lengths"],
                               mb["response_lengths"], T)

    for epoch in range(run.ppo.epochs):
        for rows in optimizer_batches(shard.size, run, 1, epoch):
            part = shard.select(rows)
            weight = part["is_end"].float() * part["train"]
            norm = denominator(part.mask * weight[:, None], agg)
            optimizer.zero_grad()
            if part.size and norm > 0:
                part.set_samples("weight", weight)
                micro = part.micro_batches(batching, samples=["weight"],
                                           per_token=["logprobs", "ref_logprobs", "advantages"], fixed_shape=False)
                T = part.max_response

                def loss_fn(output, mb, norm=norm, T=T):
                    dev = output.device
                    mask = (mb["mask"] * mb["weight"][:, None]).to(dev)
                    logp = gather_response(sequence_token_logprobs(output, mb, vocab, temperature),
                                           mb["prompt_lengths"], mb["response_lengths"], T)
                    if loss == "sft":
                        lo = aggregate(-logp, mask, "token-mean", norm)
                        totals["loss"] += float(lo)
                        totals["tokens"] += float(mask.sum())
                        return lo, {"loss": lo.detach()}
                    ent = entropy_of(output, mb, T) if terms.entropy_coef > 0 else None
                    lo, st = clipped_policy_loss(logp, mb["logprobs"].to(dev), mb["advantages"].to(dev), mask, terms,
                                                 ref_logp=mb["ref_logprobs"].to(dev), entropy=ent, norm=norm)
                    for k, v in (("loss", st.loss), ("ratio", st.ratio * st.tokens),
                                 ("clipped", st.clipped_fraction * st.tokens), ("kl", st.kl * st.tokens),
                                 ("tokens", st.tokens)):
                        totals[k] += v
                    return lo, {"loss": lo.detach()}

                run_schedule(policy, micro, loss_fn, forward_only=False)
            norms.append(optimizer.step())
    tokens = max(totals["tokens"], 1.0)
    out = {"loss": totals["loss"] / len(norms), "grad_norm": float(np.mean(norms))}
    if loss == "policy":
        out.update(ppo_ratio=totals["ratio"] / tokens, ppo_ratio_clamped=totals["clipped"] / tokens,
                   kl_loss=totals["kl"] / tokens)
    return out


@pytest.mark.parametrize("loss", ["policy", "sft"])
def test_the_update_through_the_model_worker_equals_the_actor_loop_before_it(loss: str):
    run = make_run(loss)
    with single_rank_world() as (_, pctx):
        policy, opt = policy_and_sgd(run, pctx)
        start = full_state_dict(policy, pctx)
        want_metrics = update_as_before(run, policy, opt, pctx, rollouts(), loss)
        want = full_state_dict(policy, pctx)

        policy, opt = policy_and_sgd(run, pctx)
        worker = ModelWorker.around(policy, opt, pctx, run.model,
                                    batching=run_batching(run, "actor", run.ppo.train_micro_batch_size))
        got_metrics = PolicyUpdate(run, worker, loss=loss).train(rollouts(), 1, NoTracer())
        got = full_state_dict(policy, pctx)
    assert start is not None and want is not None and got is not None
    assert got_metrics["optimizer_steps"] == 4
    assert max(float((want[k] - start[k]).abs().max()) for k in start) > 1e-3   # the update moves the weights
    for k in start:
        assert torch.equal(got[k], want[k]), k   # bit for bit
    for k, v in want_metrics.items():
        assert got_metrics[k] == pytest.approx(v, rel=1e-12, abs=1e-12), k
