"""Padded vs packed micro-batches side by side, in one run, on workload W1.

W1: GPT 4 layers, hidden 256, 4 heads, vocab 512 (max_seq_len 512 here); 64 rollouts whose
sequence lengths are long-tailed (geometric, mean 64 tokens, capped at 512; prompts of 8
tokens), 1 thread, TP=PP=DP=1.

- log-prob pass: the actor's policy log-probs of the rollouts (forward_logprobs, as
  PPOActor.logprobs runs it);
- training step: one PolicyUpdate step of the policy on them (clipped surrogate, forward +
  backward + AdamW), as the PPO/GRPO actor runs it.

padded: switches.sequence_packing and token_budget_micro_batches off (ppo.train_micro_batch_size
= 4 samples per micro-batch, right-padded, as before packing existed); packed: both on (token
budget = 4 x max_seq_len, the padded path's worst case). tokens/s counts real tokens only. Each
figure is the best of ROUNDS, the two paths alternating.

    .venv/bin/python benchmarks/bench_packing.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import warnings

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402

N, MEAN, CAP, PROMPT = 64, 64, 512, 8
W1 = dict(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=512, max_seq_len=CAP)


class NoTracer:
    def span(self, *args):
        return contextlib.nullcontext()


def rollouts(seed: int = 0):
    from slurm_align.algorithms.rollout_batch import RolloutBatch
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.geometric(1 / MEAN, size=N), PROMPT + 1, CAP)
    prompts = [rng.integers(1, 500, PROMPT) for _ in lengths]
    responses = [rng.integers(1, 500, n - PROMPT) for n in lengths]
    b = RolloutBatch.from_sequences(prompts, responses, 0, index=np.arange(N), group=np.arange(N),
                                    is_end=np.ones(N, bool))
    T = b.max_response
    g = torch.Generator().manual_seed(1)
    b.set_tokens("logprobs", -torch.rand(N, T, generator=g) * b.mask)
    b.set_tokens("ref_logprobs", b["logprobs"])
    b.set_tokens("advantages", torch.randn(N, T, generator=g) * b.mask)
    b.set_samples("train", torch.ones(N))
    return b


def run_config(packed: bool):
    from slurm_align.config.run import RunConfig
    return RunConfig(algorithm="grpo", model=W1, rl={"n_samples_per_prompt": 2},
                     reward={"rule": "slurm_align.rewards.arithmetic:exact_answer"},
                     ppo={"num_rollout_samples": N // 2, "train_micro_batch_size": 4},
                     switches={"sequence_packing": packed, "token_budget_micro_batches": packed})


def best(fn, rounds: int) -> float:
    t = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from slurm_align.algorithms.policy_gradient import PolicyUpdate
    from slurm_align.models.forward import forward_logprobs
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.optimizer import build_optimizer
    from slurm_align.models.packing import run_batching
    from slurm_align.models.worker import ModelWorker
    from slurm_align.parallel.bootstrap import init_distributed
    from slurm_align.parallel.layout import initialize_model_parallel

    pctx = initialize_model_parallel(init_distributed(), 1, 1)
    batch = rollouts()
    real = int(batch.seq_lengths.sum())
    padded_tokens = batch.size * batch.tokens.shape[1]
    cfgs = {"padded": run_config(False), "packed": run_config(True)}
    policy = build_gpt(cfgs["padded"].model, pctx, seed=3)
    start = [p.detach().clone() for c in policy for p in c.parameters()]

    def logprob_pass(name):
        run = cfgs[name]
        bt = run_batching(run, "actor", run.ppo.train_micro_batch_size)
        with torch.no_grad():
            forward_logprobs(policy, pctx, batch.tokens, run.model.vocab_size, lengths=batch.seq_lengths, batching=bt)

    def train_step(name):
        for p, s in zip((p for c in policy for p in c.parameters()), start):
            p.data.copy_(s)   # every step starts from the same weights
        run = cfgs[name]
        opt = build_optimizer([p for c in policy for p in c.parameters()], pctx, run.training, lr=1e-5)
        worker = ModelWorker.around(policy, opt, pctx, run.model,
                                    batching=run_batching(run, "actor", run.ppo.train_micro_batch_size))
        PolicyUpdate(run, worker).train(batch, 1, NoTracer())

    for name in cfgs:   # warm-up (allocations, megatron's first-call set-up)
        logprob_pass(name)
    times = {("logprob", n): float("inf") for n in cfgs} | {("train", n): float("inf") for n in cfgs}
    for _ in range(args.rounds):
        for name in cfgs:
            times[("logprob", name)] = min(times[("logprob", name)], best(functools.partial(logprob_pass, name), 1))
            times[("train", name)] = min(times[("train", name)], best(functools.partial(train_step, name), 1))

    bt = run_batching(cfgs["packed"], "actor", 4)
    groups = bt.groups(batch.seq_lengths)
    print(f"W1, {N} sequences, lengths geometric mean {MEAN} capped at {CAP}: {real} real tokens, "
          f"padded batch {batch.size} x {batch.tokens.shape[1]} = {padded_tokens} positions; "
          f"packed: {len(groups)} micro-batches (budget {bt.max_tokens} tokens), padded: {-(-N // 4)}")
    for kind in ("logprob", "train"):
        for name in cfgs:
            t = times[(kind, name)]
            print(f"  {kind:8s} {name:7s} {t:8.3f} s  {real / t:10.0f} tok/s")
    share = 1 - real / padded_tokens
    lp = times[("logprob", "padded")] / times[("logprob", "packed")]
    tr = times[("train", "padded")] / times[("train", "packed")]
    print(f"packed_over_padded_logprob_tok_s={lp:.2f} packed_over_padded_train_tok_s={tr:.2f} "
          f"padding_share_before={share:.3f}")


if __name__ == "__main__":
    main()
