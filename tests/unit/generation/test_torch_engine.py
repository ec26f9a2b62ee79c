"""The torch engines on their own (random contract-shaped weights, no megatron): seeded
sampling independent of batching, EOS/is_end, length errors, in-place refit, vocab padding."""

from __future__ import annotations

import pytest
import torch

from slurm_align.generation import GenerationError, GptShape, SamplingParams, make_engine
from slurm_align.generation.memory import TrainingStateOffload, generation_phase
from slurm_align.generation.sampling import counter_uniform, select_tokens
from slurm_align.generation.weights import expected_shapes

torch.set_num_threads(1)
SHAPE = GptShape(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                 vocab_size=100, padded_vocab_size=128, max_seq_len=40)


def random_weights(seed: int, out_std: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {k: torch.randn(s, generator=g) * 0.1 for k, s in expected_shapes(SHAPE).items()}
    sd["output_layer.weight"] *= 10 * out_std
    return sd


def prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 12, (n,), generator=g)
    return [torch.randint(0, SHAPE.vocab_size, (int(k),), generator=g) for k in lens]


@pytest.fixture(scope="module")
def engine():
    e = make_engine("torch", SHAPE)
    e.refit(random_weights(0))
    return e


def test_same_seed_same_samples_at_batch_sizes_1_7_32(engine):
    prm = prompts(32)
    seeds = list(range(1000, 1032))
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=40, top_p=0.9)
    full = engine.generate(prm, params, seeds).responses()
    for bs in (1, 7):
        order = torch.randperm(32, generator=torch.Generator().manual_seed(bs)).tolist()  # other neighbours
        for start in range(0, 32, bs):
            idx = order[start:start + bs]
            part = engine.generate([prm[i] for i in idx], params, [seeds[i] for i in idx]).responses()
            for i, r in zip(idx, part):
                assert torch.equal(r, full[i]), f"sample {i} differs at batch size {bs}"
    # Different seeds give different samples (the draws are not ignored).
    other = engine.generate(prm, params, [s + 1 for s in seeds]).responses()
    assert sum(not torch.equal(a, b) for a, b in zip(full, other)) > 16


def test_eos_stops_and_sets_is_end(engine):
    prm = prompts(16, seed=1)
    params = SamplingParams(max_new_tokens=25, temperature=1.0, seed=5)
    free_run = engine.generate(prm, params)
    # Pick as EOS a token that some (not all) samples emit.
    counts = torch.bincount(free_run.response_tokens.flatten(), minlength=SHAPE.vocab_size)
    eos = int(counts.argmax())
    out = engine.generate(prm, SamplingParams(max_new_tokens=25, temperature=1.0, seed=5, eos_id=eos, pad_id=-1))
    assert out.is_end.any()
    for i, (ref, got) in enumerate(zip(free_run.responses(), out.responses())):
        hits = (ref == eos).nonzero()
        if len(hits):  # ends right after the first EOS, which it keeps; prefix unchanged
            n = int(hits[0]) + 1
            assert bool(out.is_end[i]) and int(out.response_lengths[i]) == n
            assert torch.equal(got, ref[:n])
            assert (out.response_tokens[i, n:] == -1).all()
            assert (out.logprobs[i, n:] == 0).all()
            assert torch.allclose(out.logprobs[i, :n], free_run.logprobs[i, :n], atol=1e-5)
        else:
            assert not bool(out.is_end[i]) and int(out.response_lengths[i]) == 25
            assert torch.equal(got, ref)


@pytest.mark.parametrize("kind", ["torch", "naive"])
def test_stop_token_sequences_end_a_sample_where_they_first_complete(kind):
    """A multi-turn stop string, tokenized: the sample ends right after the first occurrence of
    the sequence (kept, is_end), its tokens and log-probs before it unchanged."""
    e = make_engine(kind, SHAPE)
    e.refit(random_weights(0))
    prm = prompts(16, seed=2)
    params = SamplingParams(max_new_tokens=25, temperature=1.0, seed=7)
    free_run = e.generate(prm, params)
    toks = free_run.response_tokens
    stop = (int(toks[0, 3]), int(toks[0, 4]))   # a pair that at least sample 0 emits
    out = e.generate(prm, SamplingParams(max_new_tokens=25, temperature=1.0, seed=7, stop_token_sequences=(stop,)))
    ended = 0
    for i, (ref, got) in enumerate(zip(free_run.responses(), out.responses())):
        at = [t + 2 for t in range(len(ref) - 1) if (int(ref[t]), int(ref[t + 1])) == stop]
        n = at[0] if at else len(ref)
        ended += bool(at)
        assert bool(out.is_end[i]) == bool(at) and int(out.response_lengths[i]) == n, i
        assert torch.equal(got, ref[:n])
        assert torch.allclose(out.logprobs[i, :n], free_run.logprobs[i, :n], atol=1e-5)
    assert ended >= 1   # sample 0 at least
    with pytest.raises(GenerationError, match="stop_token_sequences"):
        SamplingParams(stop_token_sequences=((),))


def test_length_limit_is_a_clear_error(engine):
    too_long = [torch.zeros(30, dtype=torch.long), torch.zeros(3, dtype=torch.long)]
    with pytest.raises(GenerationError, match=r"prompt 0 has 30 tokens.*max_seq_len=40"):
        engine.generate(too_long, SamplingParams(max_new_tokens=11))
    assert engine.generate(too_long, SamplingParams(max_new_tokens=10)).response_lengths.tolist() == [10, 10]
    with pytest.raises(GenerationError, match="non-empty"):
        engine.generate([torch.zeros(0, dtype=torch.long)], SamplingParams())
    with pytest.raises(GenerationError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_refit_in_place_changes_outputs_to_the_new_weights():
    prm = prompts(6, seed=2)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    fresh_b = make_engine("torch", SHAPE)
    fresh_b.refit(random_weights(2))
    for kind in ("torch", "naive"):
        eng = make_engine(kind, SHAPE)
        eng.refit(random_weights(1))
        out_a = eng.generate(prm, greedy)
        ptrs = {k: t.data_ptr() for k, t in eng.weights.tensors.items()}
        eng.refit(random_weights(2))
        assert {k: t.data_ptr() for k, t in eng.weights.tensors.items()} == ptrs  # no re-allocation
        out_b = eng.generate(prm, greedy)
        assert torch.equal(out_b.response_tokens, fresh_b.generate(prm, greedy).response_tokens)
        assert not torch.equal(out_b.response_tokens, out_a.response_tokens)  # not stale
        bad = random_weights(2)
        bad["output_layer.weight"] = bad["output_layer.weight"][:64]
        with pytest.raises(GenerationError, match=r"output_layer\.weight"):
            eng.refit(bad)
        eng.free()
        with pytest.raises(GenerationError, match="refit"):
            eng.generate(prm, greedy)


def test_padded_vocab_never_sampled():
    logits = torch.full((4, 128), -10.0)
    logits[:, 100:] = 50.0  # padding logits dominate
    logits[:, 7] = 0.0
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=2.0),
                   SamplingParams(top_k=3), SamplingParams(top_p=0.5)):
        tok, lp = select_tokens(logits, params, torch.arange(4), 0, vocab_size=100)
        assert (tok < 100).all()
        assert torch.isfinite(lp).all()


def test_top_k_and_top_p_restrict_support():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=g).expand(2000, 50)
    seeds = torch.arange(2000)
    tok, _ = select_tokens(logits, SamplingParams(top_k=5), seeds, 0, 50)
    assert set(tok.tolist()) == set(torch.topk(logits[0], 5).indices.tolist())
    p = torch.softmax(logits[0], -1)
    srt, idx = p.sort(descending=True)
    n_keep = int((srt.cumsum(0) < 0.6).sum()) + 1
    tok, _ = select_tokens(logits, SamplingParams(top_p=0.6), seeds, 0, 50)
    assert set(tok.tolist()) == set(idx[:n_keep].tolist())
    # Counter draws look uniform and depend on both seed and step.
    u = counter_uniform(torch.arange(20000), 3)
    assert abs(float(u.mean()) - 0.5) < 0.01 and float(u.min()) >= 0 and float(u.max()) < 1
    assert not torch.equal(u, counter_uniform(torch.arange(20000), 4))


def test_offload_moves_training_state_and_frees_engine():
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    grads = [p.grad.clone() for p in model.parameters()]
    off = TrainingStateOffload(opt, [model])
    eng = make_engine("torch", SHAPE)
    eng.refit(random_weights(0))
    with generation_phase(eng, off):
        assert all(p.grad is None for p in model.parameters())
    assert not eng.weights.loaded
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    opt.step()  # optimizer state still usable


def test_engine_from_run_config_follows_the_switch():
    from slurm_align.config.run import RunConfig
    from slurm_align.generation import engine_from_config
    from slurm_align.generation.naive_engine import NaiveEngine
    from slurm_align.generation.torch_engine import KVCacheEngine

    cfg = RunConfig()
    assert isinstance(engine_from_config(cfg), KVCacheEngine)
    off = cfg.model_copy(update={"switches": cfg.switches.model_copy(update={"kv_cache_engine": False})})
    assert isinstance(engine_from_config(off), NaiveEngine)
    with pytest.raises(GenerationError, match="allowed"):
        make_engine("vllm", SHAPE)
