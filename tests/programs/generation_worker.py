"""Rank program for tests/integration/test_generation_training.py (run under mpirun; not a test).

    python tests/programs/generation_worker.py TP PP OUT_DIR

Builds the contract GPT with build_gpt in a TP x PP layout, sets every weight from a function
of its GLOBAL name (so any layout holds the same model), refits the generation engines through
refit_from_training (refold on), generates, and scores the greedy responses with the training
forward (slurm_align.models.forward.forward_logits). Each rank saves OUT_DIR/rank<r>.pt.
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import sys
import zlib
from pathlib import Path

import torch

torch.set_num_threads(1)

from slurm_align.config.run import ModelConfig
from slurm_align.generation.naive_engine import NaiveEngine
from slurm_align.generation.params import GptShape, SamplingParams
from slurm_align.generation.refit import refit_from_training
from slurm_align.generation.torch_engine import KVCacheEngine
from slurm_align.parallel.bootstrap import init_distributed
from slurm_align.parallel.layout import initialize_model_parallel

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=250, max_seq_len=48)
MAX_NEW = 12


def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, MODEL.vocab_size, (n,), generator=g) for n in (5, 1, 9, 3, 12, 7, 2)]


@torch.no_grad()
def deterministic_init(chunks: list, pctx) -> None:
    """Weights as a pure function of the global name (TP=1 here: no shards to slice)."""
    from slurm_align.models.weights import local_tensors

    for name, t in local_tensors(chunks, pctx):
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        noise = torch.randn(t.shape, generator=g)
        if "layernorm" in name and name.endswith("weight"):
            t.copy_(1.0 + 0.1 * noise)
        elif name.startswith("output_layer"):
            t.copy_(0.5 * noise)  # spread logits: greedy decisions far from ties
        else:
            t.copy_(0.1 * noise)


def responses_logprobs(chunks, pctx, prm: list[torch.Tensor], out) -> tuple[torch.Tensor, torch.Tensor]:
    """Training-forward log-probs and argmax at each response position, [n, MAX_NEW] (0/-1 pad)."""
    from slurm_align.models.forward import forward_logits

    seqs = [torch.cat([p, r]) for p, r in zip(prm, out.responses())]
    width = max(s.numel() for s in seqs)
    batch = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : s.numel()] = s
    logits = forward_logits(chunks, pctx, batch, MODEL.vocab_size, broadcast=True)
    logp = torch.log_softmax(logits.double(), -1).float()
    ref_lp = torch.zeros(len(seqs), MAX_NEW)
    ref_arg = torch.full((len(seqs), MAX_NEW), -1, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prm, out.responses())):
        rows = logp[i, p.numel() - 1: p.numel() - 1 + r.numel()]
        ref_lp[i, : r.numel()] = rows.gather(1, r.unsqueeze(1)).squeeze(1)
        ref_arg[i, : r.numel()] = rows.argmax(-1)
    return ref_lp, ref_arg


def main(tp: int, pp: int, out_dir: Path) -> None:
    from slurm_align.models.gpt import build_gpt

    env = init_distributed()
    pctx = initialize_model_parallel(env, tp, pp)
    chunks = build_gpt(MODEL, pctx, seed=11)
    deterministic_init(chunks, pctx)
    shape = GptShape.from_model_config(MODEL)
    engine, naive = KVCacheEngine(shape), NaiveEngine(shape)
    result = refit_from_training(engine, chunks, pctx, refold=True)
    refit_from_training(naive, chunks, pctx, refold=True)
    prm = prompts()
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_k=50, top_p=0.95)
    seeds = [100 + i for i in range(len(prm))]
    g_out, n_out = engine.generate(prm, greedy), naive.generate(prm, greedy)
    s_out, ns_out = engine.generate(prm, sampled, seeds), naive.generate(prm, sampled, seeds)
    ref_lp, ref_arg = responses_logprobs(chunks, pctx, prm, g_out)
    if env.rank == 0 and pp == 1:
        from slurm_align.models.weights import full_state_dict
        torch.save(full_state_dict(chunks, pctx), out_dir / "full_state_dict.pt")
    torch.save({
        "greedy": g_out.response_tokens, "greedy_lp": g_out.logprobs, "greedy_len": g_out.response_lengths,
        "naive": n_out.response_tokens, "naive_lp": n_out.logprobs,
        "sampled": s_out.response_tokens, "naive_sampled": ns_out.response_tokens,
        "ref_lp": ref_lp, "ref_arg": ref_arg,
        "dp_rank": result.layout.dp_rank, "dp_size": result.layout.dp_size,
        "refit_seconds": result.seconds, "n_weights": len(engine.weights.tensors),
    }, out_dir / f"rank{env.rank}.pt")
    pctx.destroy()


if __name__ == "__main__":
    from slurm_align.launchers import leave

    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
    leave(0)   # as the product's launchers end
