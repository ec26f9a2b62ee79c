"""Rank program for tests/integration/test_packing.py (run under mpirun; not a test).

    python tests/programs/packing_worker.py ACTION TP PP OUT_DIR

forward: per shape (GPT, Llama, Qwen2), LM next-token log-probs and value-model values of the
same long-tailed batch, padded (sample-count micro-batches) vs token-budget micro-batches
padded vs packed; writes the largest differences per rank.
step: one PolicyUpdate optimizer step (clipped surrogate) from the same weights and rollouts,
micro-batched by sample count, by token budget and packed, for each loss aggregation; writes
the final weights' largest differences.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))
from models_worker import init_parallel  # noqa: E402

from slurm_align.config.run import ModelConfig, RopeScalingConfig  # noqa: E402

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


def step(pctx, out: Path) -> None:
    """One optimizer step of the policy, three micro-batchings, each loss aggregation."""
    from slurm_align.algorithms.policy_gradient import PolicyUpdate
    from slurm_align.algorithms.rollout_batch import RolloutBatch
    from slurm_align.config.run import RunConfig
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.weights import full_state_dict
    cfg = SHAPES["llama"]
    g = torch.Generator().manual_seed(5)
    plen = [3, 5, 2, 4, 6, 3, 2, 5]
    rlen = [20, 2, 9, 1, 30, 4, 12, 3]
    prompts = [torch.randint(1, 250, (p,), generator=g) for p in plen]
    responses = [torch.randint(1, 250, (r,), generator=g) for r in rlen]
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
                            ppo={"num_rollout_samples": 4, "train_micro_batch_size": micro.get("train_micro_batch_size", 4),
                                 "grad_clip": 0.0},
                            actor={"max_tokens_per_micro_batch": micro.get("max_tokens")},
                            switches={"sequence_packing": switches,
                                      "token_budget_micro_batches": "max_tokens" in micro})
            policy = build_gpt(cfg, pctx, seed=31)
            # SGD, lr 1: the weights move by exactly the gradient (AdamW's first step is
            # sign-like and would hide or blow up tiny differences).
            opt = torch.optim.SGD([p for c in policy for p in c.parameters()], lr=1.0)
            b = RolloutBatch.from_sequences(prompts, responses, pad_id=0, index=list(range(8)),
                                            group=[i // 2 for i in range(8)], is_end=[True] * 7 + [False])
            T = b.max_response
            gen = torch.Generator().manual_seed(9)
            b.set_tokens("logprobs", -torch.rand(8, T, generator=gen) * 3 * b.mask)
            b.set_tokens("ref_logprobs", b["logprobs"])
            b.set_tokens("advantages", torch.randn(8, T, generator=gen) * b.mask)
            b.set_samples("train", torch.ones(8))
            before = full_state_dict(policy, pctx)
            PolicyUpdate(run, policy, opt, pctx).train(b, 1, NoTracer())
            finals[way] = full_state_dict(policy, pctx)
        moved = max(float((finals["samples"][k] - before[k]).abs().max()) for k in before)
        result[f"{agg}/moved"] = moved
        for way in ("budget", "packed", "packed_small"):
            result[f"{agg}/{way}"] = max(float((finals[way][k] - finals["samples"][k]).abs().max()) for k in before)
    (out / f"step_{dist.get_rank()}.json").write_text(json.dumps(result))


def main(argv: list[str]) -> int:
    action, tp, pp, out = argv[0], int(argv[1]), int(argv[2]), Path(argv[3])
    pctx = init_parallel(tp, pp)
    {"forward": forward, "step": step}[action](pctx, out)
    dist.barrier()
    pctx.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
