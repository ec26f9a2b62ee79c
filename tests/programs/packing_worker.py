"""Rank program for tests/integration/test_packing.py (run under mpirun; not a test).

    python tests/programs/packing_worker.py ACTION TP PP OUT_DIR

forward: per shape (GPT, Llama, Qwen2), LM next-token log-probs and value-model values of the
same long-tailed batch, padded (sample-count micro-batches) vs token-budget micro-batches
padded vs packed; writes the largest differences per rank.
step: one PolicyUpdate optimizer step (clipped surrogate) from the same weights and rollouts,
micro-batched by sample count, by token budget and packed, for each loss aggregation; writes
the final weights' largest differences.
corrected (TP 1, PP 1): the same step with rollout correction (token_truncate) on rollouts whose
engine log-probs are not the trainer's, the three micro-batchings against the step written out
here by hand with and without the correction's weights; writes the largest differences.
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import contextlib
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))
from models_worker import init_parallel

from slurm_align.config.run import ModelConfig, RopeScalingConfig

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()


def sgd(policy: list, pctx, run):
    """The run's optimizer (models/optimizer.build_optimizer: reduce, clip, step) with SGD at lr 1
    inside: the weights move by exactly the gradient (AdamW's first step is sign-like and would
    hide or blow up tiny differences)."""
    from slurm_align.models.optimizer import build_optimizer

    opt = build_optimizer([p for c in policy for p in c.parameters()], pctx, run.training, lr=1.0)
    opt.optimizer = torch.optim.SGD(opt.params, lr=1.0)   # the schedule steps the AdamW it replaced
    return opt


BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=260, max_seq_len=64)
SHAPES = {
    "gpt": ModelConfig(**BASE),
    "llama": ModelConfig(**BASE, position_embedding="rope", normalization="RMSNorm", activation="swiglu",
                         num_query_groups=2, add_bias_linear=False, tie_embeddings=True,
                         rope_scaling=RopeScalingConfig(factor=8.0, original_max_position_embeddings=16)),
    "qwen2": ModelConfig(**BASE, position_embedding="rope", normalization="RMSNorm", activation="swiglu",
                         num_query_groups=2, add_bias_linear=False, add_qkv_bias=True, rotary_base=1e6,
                         norm_epsilon=1e-6),
}


class NoTracer:
    def span(self, *args):
        return contextlib.nullcontext()


def batch(n: int = 10, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tokens [n, L] with long-tailed lengths (most short, one near max)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 40, 5, 7, 2, 11, 4, 6, 23, 9][:n])
    tokens = torch.randint(1, 250, (n, int(lengths.max())), generator=g)
    tokens[torch.arange(tokens.shape[1])[None, :] >= lengths[:, None]] = 0
    return tokens, lengths


def forward(pctx, out: Path) -> None:
    from slurm_align.models.forward import forward_logprobs, forward_values
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.packing import Batching
    tokens, lengths = batch()
    ways = {"padded": Batching(micro_batch_size=3), "budget": Batching(max_tokens=48),
            "packed": Batching(max_tokens=48, pack=True), "packed_one": Batching(pack=True),
            "packed_small": Batching(max_tokens=16, pack=True)}   # 40 and 23 tokens go alone
    pos = torch.arange(tokens.shape[1])[None, :]
    result = {}
    for name, cfg in SHAPES.items():
        lm = build_gpt(cfg, pctx, seed=21)
        vm = build_gpt(cfg, pctx, value_head=True, seed=22)
        lp = {w: forward_logprobs(lm, pctx, tokens, cfg.vocab_size, lengths=lengths, batching=b, broadcast=True)
              for w, b in ways.items()}
        vals = {w: forward_values(vm, pctx, tokens, lengths=lengths, batching=b, broadcast=True)
                for w, b in ways.items()}
        lp_mask = (pos[:, :-1] < lengths[:, None] - 1).float()
        v_mask = (pos < lengths[:, None]).float()
        for w in ways:
            if w == "padded":
                continue
            result[f"{name}/logprobs/{w}"] = float(((lp[w] - lp["padded"]) * lp_mask).abs().max())
            result[f"{name}/values/{w}"] = float(((vals[w] - vals["padded"]) * v_mask).abs().max())
        # Not vacuous: the outputs differ between sequences and from zero.
        result[f"{name}/logprobs/scale"] = float((lp["padded"] * lp_mask).abs().max())
        result[f"{name}/values/spread"] = float((vals["padded"] * v_mask).std())
    (out / f"forward_{dist.get_rank()}.json").write_text(json.dumps(result))


def sequences() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """8 prompts and responses of long-tailed lengths (token ids)."""
    g = torch.Generator().manual_seed(5)
    plen = [3, 5, 2, 4, 6, 3, 2, 5]
    rlen = [20, 2, 9, 1, 30, 4, 12, 3]
    prompts = [torch.randint(1, 250, (p,), generator=g) for p in plen]
    return prompts, [torch.randint(1, 250, (r,), generator=g) for r in rlen]


def rollouts():
    """The step's RolloutBatch: `sequences()`, the last response cut (not ended), pi_old and
    advantages drawn at random, every sample kept."""
    from slurm_align.algorithms.rollout_batch import RolloutBatch
    prompts, responses = sequences()
    b = RolloutBatch.from_sequences(prompts, responses, pad_id=0, index=list(range(8)),
                                    group=[i // 2 for i in range(8)], is_end=[True] * 7 + [False])
    T = b.max_response
    gen = torch.Generator().manual_seed(9)
    b.set_tokens("logprobs", -torch.rand(8, T, generator=gen) * 3 * b.mask)
    b.set_tokens("ref_logprobs", b["logprobs"])
    b.set_tokens("advantages", torch.randn(8, T, generator=gen) * b.mask)
    b.set_samples("train", torch.ones(8))
    return b


def policy_update(run, policy, opt, pctx):
    """The actor's PolicyUpdate over the one model worker's step, around this policy and optimizer
    (as build_actor's worker: the run's actor micro-batching)."""
    from slurm_align.algorithms.policy_gradient import PolicyUpdate
    from slurm_align.models.packing import run_batching
    from slurm_align.models.worker import ModelWorker
    worker = ModelWorker.around(policy, opt, pctx, run.model,
                                batching=run_batching(run, "actor", run.ppo.train_micro_batch_size))
    return PolicyUpdate(run, worker)


def step(pctx, out: Path) -> None:
    """One optimizer step of the policy, three micro-batchings, each loss aggregation."""
    from slurm_align.config.run import RunConfig
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.weights import full_state_dict
    cfg = SHAPES["llama"]
    result = {}
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        finals = {}
        for way, switches, micro in (("samples", False, {"train_micro_batch_size": 3}),
                                     ("budget", False, {"max_tokens": 40}),
                                     ("packed", True, {"max_tokens": 40}),
                                     # under the longest sequence (36 tokens): it goes alone
                                     ("packed_small", True, {"max_tokens": 20})):
            run = RunConfig(algorithm="grpo", model=cfg, rl={"n_samples_per_prompt": 2, "loss_agg": agg},
                            reward={"rule": "slurm_align.rewards.arithmetic:exact_answer"},
                            ppo={"num_rollout_samples": 4, "grad_clip": 0.0,
                                 "train_micro_batch_size": micro.get("train_micro_batch_size", 4)},
                            actor={"max_tokens_per_micro_batch": micro.get("max_tokens")},
                            switches={"sequence_packing": switches,
                                      "token_budget_micro_batches": "max_tokens" in micro})
            policy = build_gpt(cfg, pctx, seed=31)
            opt = sgd(policy, pctx, run)
            b = rollouts()
            before = full_state_dict(policy, pctx)
            policy_update(run, policy, opt, pctx).train(b, 1, NoTracer())
            finals[way] = full_state_dict(policy, pctx)
        moved = max(float((finals["samples"][k] - before[k]).abs().max()) for k in before)
        result[f"{agg}/moved"] = moved
        for way in ("budget", "packed", "packed_small"):
            result[f"{agg}/{way}"] = max(float((finals[way][k] - finals["samples"][k]).abs().max()) for k in before)
    (out / f"step_{dist.get_rank()}.json").write_text(json.dumps(result))


C = 2.0
"""The correction's threshold in `corrected`."""


def engine_logprobs(b) -> torch.Tensor:
    """log pi_rollout: pi_old moved by up to about +-1.5 per token (an engine off the trainer's
    policy), so the TIS weights min(exp(log pi_old - log pi_rollout), C) spread over (0.2, C]."""
    gen = torch.Generator().manual_seed(13)
    return (b["logprobs"] + torch.randn(b["logprobs"].shape, generator=gen) * 0.6) * b.mask


def step_by_hand(cfg, pctx, correct: bool) -> dict[str, torch.Tensor]:
    """The weights after the corrected (or the uncorrected) step, written out without the
    product's loss, batching or correction code: one forward of the whole right-padded batch,
    log p of each response token, w = min(exp(log pi_old - log pi_rollout), C) (or 1),
    -w min(r A, clip(r, 0.8, 1.2) A) per token, mean over the tokens of the responses that ended,
    backward, SGD with lr 1."""
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.weights import full_state_dict
    policy = build_gpt(cfg, pctx, seed=31)
    prompts, responses = sequences()
    b = rollouts()
    seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    L = max(len(q) for q in seqs)
    tokens = torch.zeros(len(seqs), L, dtype=torch.int64)
    for i, q in enumerate(seqs):
        tokens[i, :len(q)] = q
    causal = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)[None, None]   # True: masked out
    logits = policy[0](input_ids=tokens, position_ids=torch.arange(L)[None].expand(len(seqs), L),
                       attention_mask=causal)[..., :cfg.vocab_size]
    next_lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    old, adv, rollout = b["logprobs"], b["advantages"], engine_logprobs(b)
    loss, count = 0.0, 0
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if i == 7:      # cut at max_new_tokens (is_end False): teaches nothing
            continue
        for t in range(len(r)):
            logp = next_lp[i, len(p) - 1 + t]        # the position that predicts response token t
            w = min(math.exp(float(old[i, t]) - float(rollout[i, t])), C) if correct else 1.0
            ratio = torch.exp(logp - float(old[i, t]))
            a = float(adv[i, t])
            loss = loss - w * torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
            count += 1
    (loss / count).backward()
    with torch.no_grad():
        for chunk in policy:
            for param in chunk.parameters():
                if param.grad is not None:
                    param -= param.grad
    return full_state_dict(policy, pctx)


def corrected(pctx, out: Path) -> None:
    """PolicyUpdate with rollout_correction token_truncate through sample-count, token-budget and
    packed micro-batches (the weights column rides in the micro-batches), against step_by_hand."""
    from slurm_align.algorithms import rollout_correction as rc
    from slurm_align.config.run import RunConfig
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.weights import full_state_dict
    cfg = SHAPES["llama"]
    want = {"corrected": step_by_hand(cfg, pctx, True), "uncorrected": step_by_hand(cfg, pctx, False)}
    def diff(a: dict, b: dict) -> float:
        return max(float((a[k] - b[k]).abs().max()) for k in b)
    result = {"correction_moves_the_step": diff(want["corrected"], want["uncorrected"])}
    for way, micro in (("samples", {"train_micro_batch_size": 3}), ("budget", {"max_tokens": 40}),
                       ("packed", {"max_tokens": 40, "pack": True})):
        run = RunConfig(algorithm="grpo", model=cfg, rl={"n_samples_per_prompt": 2},
                        reward={"rule": "slurm_align.rewards.arithmetic:exact_answer"},
                        ppo={"num_rollout_samples": 4, "train_micro_batch_size": micro.get("train_micro_batch_size", 4),
                             "grad_clip": 0.0},
                        actor={"max_tokens_per_micro_batch": micro.get("max_tokens")},
                        switches={"sequence_packing": micro.get("pack", False),
                                  "token_budget_micro_batches": "max_tokens" in micro},
                        rollout_correction={"mode": "token_truncate", "threshold": C})
        policy = build_gpt(cfg, pctx, seed=31)
        opt = sgd(policy, pctx, run)
        b = rollouts()
        b.set_tokens("rollout_logprobs", engine_logprobs(b))
        m = rc.apply(run.rollout_correction, b, None)   # the column estimate_advantages sets
        result[f"{way}/weight_min"] = float(b[rc.WEIGHTS][b.mask > 0].min())
        result[f"{way}/weight_max"] = m["rollout_correction_weight_max"]
        policy_update(run, policy, opt, pctx).train(b, 1, NoTracer())
        got = full_state_dict(policy, pctx)
        for name, weights in want.items():
            result[f"{way}/vs_{name}"] = diff(got, weights)
    (out / f"corrected_{dist.get_rank()}.json").write_text(json.dumps(result))


def main(argv: list[str]) -> int:
    action, tp, pp, out = argv[0], int(argv[1]), int(argv[2]), Path(argv[3])
    pctx = init_parallel(tp, pp)
    {"forward": forward, "step": step, "corrected": corrected}[action](pctx, out)
    dist.barrier()
    pctx.destroy()
    return 0


if __name__ == "__main__":
    from slurm_align.launchers import leave

    leave(main(sys.argv[1:]))   # as the product's launchers end
