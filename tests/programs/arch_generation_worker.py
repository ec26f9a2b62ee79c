"""Rank program for tests/integration/test_generation_hf.py (one process, TP=PP=1; not a test).

    python tests/programs/arch_generation_worker.py OUT_DIR NAME...
    python tests/programs/arch_generation_worker.py OUT_DIR --hf FOLDER...

For each architecture NAME of ARCHS: build the megatron-core model with build_gpt, set every
weight from a function of its name, refit the KV-cache and naive engines from the training
model (refit_from_training), generate greedily and with seeded sampling, and score the greedy
responses with the training forward. Saves OUT_DIR/NAME.pt.
With --hf: each Hugging Face FOLDER is imported (build_gpt with model.hf_path), the engines are
refitted from it and generate greedily from OUT_DIR/prompts.pt; saves OUT_DIR/<folder name>.pt.
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

from generation_worker import deterministic_init

from slurm_align.config.run import ModelConfig
from slurm_align.generation.naive_engine import NaiveEngine
from slurm_align.generation.params import GptShape, SamplingParams
from slurm_align.generation.refit import refit_from_training
from slurm_align.generation.torch_engine import KVCacheEngine
from slurm_align.parallel.bootstrap import init_distributed
from slurm_align.parallel.layout import initialize_model_parallel

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()

_COMMON = dict(num_layers=2, vocab_size=250, max_seq_len=48)
ARCHS = {
    # Llama 3: GQA (8 heads, 2 groups), RoPE with Llama-3 scaling, RMSNorm, SwiGLU, no biases, untied.
    "llama": ModelConfig(**_COMMON, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                         position_embedding="rope", rotary_base=500000.0,
                         rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 16},
                         normalization="RMSNorm", norm_epsilon=1e-6, activation="swiglu", add_bias_linear=False),
    # Qwen2: GQA, RoPE, RMSNorm, SwiGLU, bias in QKV only, tied embeddings, head dim != hidden/heads.
    "qwen2": ModelConfig(**_COMMON, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=24,
                         ffn_hidden_size=80, position_embedding="rope", rotary_base=1000000.0,
                         normalization="RMSNorm", norm_epsilon=1e-6, activation="swiglu", add_bias_linear=False,
                         add_qkv_bias=True, tie_embeddings=True),
    # GPT-2: learned positions, LayerNorm, tanh GELU, biases, tied.
    "gpt2": ModelConfig(**_COMMON, hidden_size=64, num_attention_heads=4, activation="gelu_tanh",
                        tie_embeddings=True),
}
MAX_NEW = 12


def prompts(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g) for n in (5, 1, 9, 3, 12, 7, 2)]


def scored(chunks, pctx, cfg: ModelConfig, prm, out) -> tuple[torch.Tensor, torch.Tensor]:
    """Training-forward log-probs and argmax at each response position, [n, MAX_NEW] (0/-1 pad)."""
    from slurm_align.models.forward import forward_logits

    seqs = [torch.cat([p, r]) for p, r in zip(prm, out.responses())]
    batch = torch.zeros(len(seqs), max(s.numel() for s in seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : s.numel()] = s
    logp = torch.log_softmax(forward_logits(chunks, pctx, batch, cfg.vocab_size, broadcast=True).double(), -1)
    ref_lp = torch.zeros(len(seqs), MAX_NEW)
    ref_arg = torch.full((len(seqs), MAX_NEW), -1, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prm, out.responses())):
        rows = logp[i, p.numel() - 1: p.numel() - 1 + r.numel()].float()
        ref_lp[i, : r.numel()] = rows.gather(1, r.unsqueeze(1)).squeeze(1)
        ref_arg[i, : r.numel()] = rows.argmax(-1)
    return ref_lp, ref_arg


def imported(pctx, out_dir: Path, folders: list[str]) -> None:
    from slurm_align.models.gpt import build_gpt

    prm = torch.load(out_dir / "prompts.pt")
    for folder in map(Path, folders):
        cfg = ModelConfig(hf_path=folder, max_seq_len=64)
        chunks = build_gpt(cfg, pctx, seed=11)
        shape = GptShape.from_model_config(cfg)
        engine, naive = KVCacheEngine(shape), NaiveEngine(shape)
        refit_from_training(engine, chunks, pctx, refold=True)
        refit_from_training(naive, chunks, pctx, refold=True)
        greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
        torch.save({"greedy": engine.generate(prm, greedy).response_tokens,
                    "naive": naive.generate(prm, greedy).response_tokens}, out_dir / f"{folder.name}.pt")


def main(out_dir: Path, names: list[str]) -> None:
    from slurm_align.models.gpt import build_gpt

    pctx = initialize_model_parallel(init_distributed(), 1, 1)
    if names[0] == "--hf":
        imported(pctx, out_dir, names[1:])
        names = []
    for name in names:
        cfg = ARCHS[name]
        chunks = build_gpt(cfg, pctx, seed=11)
        deterministic_init(chunks, pctx)
        shape = GptShape.from_model_config(cfg)
        engine, naive = KVCacheEngine(shape), NaiveEngine(shape)
        refit_from_training(engine, chunks, pctx, refold=True)
        refit_from_training(naive, chunks, pctx, refold=True)
        prm = prompts(cfg.vocab_size)
        greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
        sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_k=50, top_p=0.95)
        seeds = [100 + i for i in range(len(prm))]
        g_out, n_out = engine.generate(prm, greedy), naive.generate(prm, greedy)
        s_out, ns_out = engine.generate(prm, sampled, seeds), naive.generate(prm, sampled, seeds)
        ref_lp, ref_arg = scored(chunks, pctx, cfg, prm, g_out)
        torch.save({
            "greedy": g_out.response_tokens, "greedy_lp": g_out.logprobs,
            "naive": n_out.response_tokens, "naive_lp": n_out.logprobs,
            "sampled": s_out.response_tokens, "naive_sampled": ns_out.response_tokens,
            "sampled_lp": s_out.logprobs, "ref_lp": ref_lp, "ref_arg": ref_arg,
            "kv_heads_cached": engine._kv_store.numel() // (shape.num_layers * 2 * len(prm) * shape.head_dim
                                                            * (max(p.numel() for p in prm) + MAX_NEW)),
        }, out_dir / f"{name}.pt")
    pctx.destroy()


if __name__ == "__main__":
    from slurm_align.launchers import leave

    main(Path(sys.argv[1]), sys.argv[2:])
    leave(0)   # as the product's launchers end
