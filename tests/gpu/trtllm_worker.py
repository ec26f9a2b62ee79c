"""GPU rank program for tests/integration/test_generation_trtllm.py (run under mpirun; not a test).

    mpirun -n TP python tests/gpu/trtllm_worker.py TP

A Qwen2-style megatron model (GQA, SwiGLU, RMSNorm, rope, QKV bias, tied) built on CUDA at
tensor parallel TP, its TensorRT-LLM engine refitted in place from the training shards
(refit_from_training, refolded layout), and checked:
- bfloat16 by default; greedy tokens equal to transformers' Qwen2 on the same weights (the
  numerical reference) and to the torch engine's (the embedding is scaled up so the argmax has
  real margins, not ties);
- EOS: a token the model does emit is made the EOS: that sample stops on it, is_end, length
  counts it; samples that never emit it run to max_new_tokens with is_end False;
- per-sample seeds: a sample draws the same tokens alone or in a batch;
- sleep (weights and KV cache released: free GPU memory grows), then in place: new training
  weights -> a second refit (waking all but the KV cache, then the KV cache) -> the new reference's tokens;
- free and reload: free(), refit, the same tokens again.
Prints TRTLLM_OK on every rank.
"""

from __future__ import annotations

import sys

import torch


def reference_greedy(cfg, full: dict, prompts: list[torch.Tensor], n_new: int) -> list[list[int]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from slurm_align.generation.trtllm_mapping import hf_config, hf_weights

    hf_cfg = AutoConfig.for_model(**{k: v for k, v in hf_config(cfg).items() if k not in ("architectures",)})
    model = AutoModelForCausalLM.from_config(hf_cfg).to("cuda", torch.float32).eval()
    missing, unexpected = model.load_state_dict(hf_weights(full, cfg), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    model.tie_weights()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(p.view(1, -1).cuda(), do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new,
                                 attention_mask=torch.ones(1, p.numel(), dtype=torch.long, device="cuda"))
            out.append(ids[0, p.numel():].tolist())
    return out


def main() -> None:
    tp = int(sys.argv[1])
    from slurm_align.config.run import ModelConfig
    from slurm_align.generation import GptShape, SamplingParams, make_engine
    from slurm_align.generation.refit import refit_from_training
    from slurm_align.generation.trtllm_engine import TrtllmEngine
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.weights import full_state_dict, load_full_state_dict
    from slurm_align.parallel.bootstrap import init_distributed, shutdown_distributed
    from slurm_align.parallel.layout import initialize_model_parallel

    env = init_distributed()
    pctx = initialize_model_parallel(env, tp, 1)
    cfg = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=256,
                      vocab_size=500, max_seq_len=128, position_embedding="rope", normalization="RMSNorm",
                      activation="swiglu", add_bias_linear=False, add_qkv_bias=True, tie_embeddings=True)
    chunks = build_gpt(cfg, pctx, seed=5)
    assert next(chunks[0].parameters()).is_cuda, "the megatron model is not on the GPU"

    def set_weights(scale: float, seed: int) -> dict:
        full = full_state_dict(chunks, pctx)
        g = torch.Generator().manual_seed(seed)
        full = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in full.items()}
        full["embedding.word_embeddings.weight"] *= scale  # peaked logits: greedy has margins
        load_full_state_dict(chunks, pctx, full)
        return full

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (5, 17, 9, 30)]
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    with pctx.generation_layout(True) as layout:
        engine = TrtllmEngine.for_layout(cfg, layout, env.device)
    assert engine.options.dtype == "bfloat16" and engine.tp_size == tp

    full = set_weights(40.0, 1)
    first = refit_from_training(engine, chunks, pctx).seconds  # creates the LLM, then loads
    out = engine.generate(prompts, greedy)
    want = reference_greedy(cfg, full, prompts, 16)
    assert [r.tolist() for r in out.responses()] == want, ([r.tolist() for r in out.responses()], want)
    torch_engine = make_engine("torch", GptShape.from_model_config(cfg), env.device)
    refit_from_training(torch_engine, chunks, pctx)
    assert [r.tolist() for r in torch_engine.generate(prompts, greedy).responses()] == want  # the torch engine's too
    torch_engine.free()
    assert out.logprobs is None and out.response_lengths.tolist() == [16] * len(prompts)

    eos = int(out.response_tokens[0, 2])
    ended = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0, eos_id=eos))
    for i, resp in enumerate(ended.responses()):
        if eos in want[i]:
            k = want[i].index(eos) + 1
            assert resp.tolist() == want[i][:k] and bool(ended.is_end[i]), (i, resp, want[i])
        else:
            assert resp.tolist() == want[i] and not bool(ended.is_end[i]), (i, resp)
    assert bool(ended.is_end[0]) and int(ended.response_lengths[0]) <= 3

    sampled = SamplingParams(max_new_tokens=12, temperature=1.0)
    batch = engine.generate(prompts, sampled, [5, 6, 7, 8])
    alone = engine.generate(prompts[1:2], sampled, [6])
    assert torch.equal(batch.responses()[1], alone.responses()[0])
    assert batch.logprobs is not None, "plain sampling returned no per-token log-probs"
    assert bool(torch.isfinite(batch.logprobs).all() and (batch.logprobs <= 0).all())

    # asleep for a "training step": weights and KV cache released, GPU memory back
    free_before = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert torch.cuda.mem_get_info()[0] > free_before, "sleep released no GPU memory"
    full = set_weights(1.0, 2)  # a "training step": every weight moves
    second = refit_from_training(engine, chunks, pctx).seconds  # wakes weights, refits in place, wakes KV cache
    want2 = reference_greedy(cfg, full, prompts, 16)
    again = engine.generate(prompts, greedy)
    assert [r.tolist() for r in again.responses()] == want2 != want

    engine.free()
    refit_from_training(engine, chunks, pctx)
    assert [r.tolist() for r in engine.generate(prompts, greedy).responses()] == want2
    print(f"TRTLLM_OK rank={env.rank} tp={tp} first_refit_s={first:.2f} refit_s={second:.3f}", flush=True)
    engine.free()
    pctx.destroy()
    shutdown_distributed(env)


if __name__ == "__main__":
    main()
