"""Rank program for tests/integration/test_rollout_correction.py (run under mpirun -n 1; not a test).

    python tests/programs/rollout_logprobs_worker.py OUT_FILE

Builds a real megatron-core GPT (build_gpt, TP=PP=1) with deterministic weights, refits the
KV-cache and naive engines from it (refit_from_training), samples at temperature 0.7 with
top-k/top-p, and recomputes the sampled tokens' log-probs the way the trainer does for pi_old
(forward_logits + next_token_logprobs at the run's temperature, PPOActor.logprobs) and the way the
policy loss does (token_logprobs on the model output). Saves both with the engines' log-probs.
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

from generation_worker import deterministic_init

from slurm_align.algorithms.rollout_batch import RolloutBatch, rollout_logprobs
from slurm_align.config.run import ModelConfig
from slurm_align.data.positions import gather_response
from slurm_align.generation.naive_engine import NaiveEngine
from slurm_align.generation.params import GptShape, SamplingParams, logprob_temperature
from slurm_align.generation.refit import refit_from_training
from slurm_align.generation.torch_engine import KVCacheEngine
from slurm_align.models.forward import (
    forward_logits,
    forward_logprobs,
    model_inputs,
    next_token_logprobs,
    token_logprobs,
)
from slurm_align.models.gpt import build_gpt
from slurm_align.models.packing import Batching
from slurm_align.parallel.bootstrap import init_distributed
from slurm_align.parallel.layout import initialize_model_parallel

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=250, max_seq_len=48)
TEMPERATURE = 0.7


def main(out_file: Path) -> None:
    env = init_distributed()
    pctx = initialize_model_parallel(env, 1, 1)
    chunks = build_gpt(MODEL, pctx, seed=11)
    deterministic_init(chunks, pctx)
    shape = GptShape.from_model_config(MODEL)
    engine, naive = KVCacheEngine(shape), NaiveEngine(shape)
    refit_from_training(engine, chunks, pctx, refold=True)
    refit_from_training(naive, chunks, pctx, refold=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, MODEL.vocab_size, (n,), generator=g) for n in (5, 1, 9, 3, 12, 7)]
    params = SamplingParams(max_new_tokens=12, temperature=TEMPERATURE, top_k=40, top_p=0.9)
    seeds = [500 + i for i in range(len(prompts))]
    out, n_out = engine.generate(prompts, params, seeds), naive.generate(prompts, params, seeds)
    batch = RolloutBatch.from_sequences(prompts, out.responses(), 0)
    T = batch.max_response
    temperature = logprob_temperature(TEMPERATURE)
    # pi_old as PPOActor.logprobs computes it (packed micro-batches, at the run's temperature)
    old = batch.from_positions(forward_logprobs(chunks, pctx, batch.tokens, MODEL.vocab_size,
                                                lengths=batch.seq_lengths, batching=Batching(pack=True),
                                                broadcast=True, temperature=temperature))
    logits = forward_logits(chunks, pctx, batch.tokens, MODEL.vocab_size, broadcast=True)
    raw = batch.from_positions(next_token_logprobs(logits, batch.tokens))
    # pi_theta as the policy loss computes it (token_logprobs on the model's output)
    with torch.no_grad():
        output = chunks[0](**model_inputs(batch.tokens))
    loss_lp = gather_response(token_logprobs(output, batch.tokens, MODEL.vocab_size, temperature),
                              batch.prompt_lengths, batch.response_lengths, T)
    torch.save({"engine": rollout_logprobs(out, T), "naive": rollout_logprobs(n_out, T), "old": old, "raw": raw,
                "loss": loss_lp, "mask": batch.mask, "same_tokens": torch.equal(out.response_tokens,
                                                                               n_out.response_tokens)}, out_file)
    pctx.destroy()


if __name__ == "__main__":
    from slurm_align.launchers import leave

    main(Path(sys.argv[1]))
    leave(0)   # as the product's launchers end
