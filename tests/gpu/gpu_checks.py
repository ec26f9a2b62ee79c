"""The GPU checks that need no launcher, no registry and no TensorRT-LLM: one process, one GPU.

    python tests/gpu/gpu_checks.py [--device cuda] [--out figures.json]

Run by tests/gpu/run_gpu_checks.sh on the GPU machine (no mpirun there: torch.distributed is
started here with a single-rank store, not through slurm_align's MPI bootstrap). Each check
prints `CHECK <name> OK|FAIL|SKIP <detail>`; the figures go to --out (JSON) and a last line:
    torch_gpu_tok_s=... refit_s=... grpo_step_s=...
Checks:
- nccl: torch.distributed with NCCL on this GPU, an all-reduce (gloo on --device cpu);
- megatron_local: megatron-core's GPTModel (local layer spec) built and run on the device, its
  logits equal to transformers' float32 forward of the same weights on the CPU (megatron itself
  cannot run on the CPU in a CUDA process: its CPU compatibility layer is off there);
- megatron_te: the same with the Transformer Engine spec (tests/gpu/te_spec_worker.py), when TE
  is importable;
- kv_engine_bf16: a tiny Hugging Face Llama, imported into megatron (model.hf_path), refitted
  into the torch KV-cache engine in bf16 on the device; each of its greedy tokens is the argmax
  of transformers' bf16 forward on the same device over the same sequence (teacher-forced), or
  within bf16 rounding of it (a near-tie), and at least 90% are exactly the argmax;
- refit: the training weights changed (noise on every matrix), the engine refitted from them
  (timed); its greedy tokens and log-probs then equal those of a fresh engine given only the new
  weights, and differ from its own before the refit (a refit that does nothing fails); its first
  token is the training model's argmax (or a bf16 near-tie);
- grpo_step: a GRPO step on the device: seeded samples from the engine, a rule reward, group
  advantages (algorithms.advantages.grpo), the policy-gradient loss, backward, AdamW; checks that
  the update raised the log-probability of the better-than-group samples relative to the worse;
- tokens/s of the torch engine in bf16 on the device (a W1-sized model), for the last line.
--device cpu runs the same code on CPU (CI does, to keep this program working without a GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from slurm_align.config.run import ModelConfig  # noqa: E402
from slurm_align.generation.params import GptShape, SamplingParams  # noqa: E402
from slurm_align.generation.torch_engine import KVCacheEngine  # noqa: E402
from slurm_align.generation.weights import GptWeights  # noqa: E402

RESULTS: dict[str, str] = {}
FIGURES: dict[str, float | None] = {"torch_gpu_tok_s": None, "refit_s": None, "grpo_step_s": None}
LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=250, max_position_embeddings=128, initializer_range=0.3, rms_norm_eps=1e-6)


def report(name: str, status: str, detail: str = "") -> None:
    RESULTS[name] = status
    print(f"CHECK {name} {status} {detail}".rstrip(), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SoloEnv:
    """slurm_align.parallel.bootstrap.DistEnv's fields for one process started here."""

    def __init__(self, device: torch.device):
        import torch.distributed as dist

        self.backend = "nccl" if device.type == "cuda" else "gloo"
        store = dist.HashStore()
        dist.init_process_group(self.backend, store=store, rank=0, world_size=1)
        self.rank, self.world_size, self.local_rank, self.local_size = 0, 1, 0, 1
        self.node, self.comm, self.device = socket.gethostname(), None, str(device)
        self.node_rank, self.num_nodes, self.master_addr, self.master_port = 0, 1, "127.0.0.1", 0


def check_nccl(device: torch.device) -> None:
    import torch.distributed as dist

    t = torch.arange(4.0, device=device)
    dist.all_reduce(t)
    ok = t.tolist() == [0.0, 1.0, 2.0, 3.0] and dist.get_backend() == ("nccl" if device.type == "cuda" else "gloo")
    report("nccl", "OK" if ok else "FAIL", f"backend={dist.get_backend()} all_reduce={t.tolist()}")


def megatron_model(cfg: ModelConfig, pctx, device: torch.device, seed: int = 5) -> list:
    from slurm_align.models.gpt import build_gpt

    chunks = build_gpt(cfg, pctx, seed=seed)
    return [c.to(device) for c in chunks]


def hf_reference(cfg: ModelConfig, full: dict[str, torch.Tensor]):
    """transformers' model of the same architecture holding `full` (a megatron full state dict),
    float32 on the CPU: the independent numerical reference (a CPU forward of transformers is
    valid in a CUDA process; megatron's is not, its CPU compatibility layer being off there)."""
    import transformers

    from slurm_align.generation.trtllm_mapping import hf_config, hf_weights

    conf = {k: v for k, v in hf_config(cfg).items() if k != "architectures"}
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**conf))
    missing, unexpected = model.load_state_dict(hf_weights({k: t.cpu() for k, t in full.items()}, cfg), strict=False)
    if unexpected or not all("lm_head" in k for k in missing):
        raise RuntimeError(f"HF reference: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.float().eval()


def check_megatron_local(pctx, device: torch.device) -> None:
    from slurm_align.models.forward import forward_logits
    from slurm_align.models.weights import full_state_dict

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                      vocab_size=200, max_seq_len=32, position_embedding="rope", normalization="RMSNorm",
                      activation="swiglu", add_bias_linear=False)
    tokens = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    if device.type == "cuda":   # IEEE float32 matmuls (TF32, where a library turned it on, is 1e-3 relative)
        torch.backends.cuda.matmul.allow_tf32 = False
    chunks = megatron_model(cfg, pctx, device)   # built where it runs: megatron on CUDA stays on CUDA
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights of unit scale (not init's 0.02): logits of order 1, so that errors show
        for c in chunks:
            for p in c.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    got = forward_logits(chunks, pctx, tokens.to(device), cfg.vocab_size).float().cpu()
    with torch.no_grad():
        want = hf_reference(cfg, full_state_dict(chunks, pctx))(tokens).logits.float()
    where = {p.device.type for c in chunks for p in c.parameters()}
    err = float((got - want).abs().max())
    scale = float(want.abs().max())
    # float32 both; 1e-4 of the logits' scale covers two libraries' reduction orders (measured on
    # CPU: about 1e-7), while a wrong RoPE base or norm epsilon moves logits by 1e-2 and more
    ok = where == {device.type} and bool(torch.isfinite(got).all()) and err <= 1e-4 * scale
    report("megatron_local", "OK" if ok else "FAIL", f"params on {sorted(where)}, max |logits - transformers' "
           f"float32 CPU forward of the same weights| = {err:.2e} (logits up to {scale:.2f})")


def check_megatron_te(device: torch.device) -> None:
    if device.type != "cuda":
        return report("megatron_te", "SKIP", "needs CUDA")
    if importlib.util.find_spec("transformer_engine") is None:
        return report("megatron_te", "SKIP", "Transformer Engine is not installed (too large to bring: CUDA build)")
    proc = subprocess.run([sys.executable, "-W", "ignore", str(REPO / "tests/gpu/te_spec_worker.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    ok = proc.returncode == 0 and "TE_SPEC_OK" in proc.stdout
    report("megatron_te", "OK" if ok else "FAIL", "" if ok else (proc.stdout + proc.stderr)[-2000:])


def near_tie(top2: torch.Tensor) -> bool:
    """Top-2 logits closer than two bf16 implementations may disagree by (3% relative: bf16
    keeps 8 bits of mantissa, and the error grows through the layers)."""
    return float(top2[0] - top2[1]) <= 2 ** -5 * max(1.0, float(top2[0].abs()))


def bf16_engine(shape: GptShape, device: torch.device) -> KVCacheEngine:
    """The torch KV-cache engine with bf16 weights and cache (its default is float32)."""
    engine = KVCacheEngine(shape, device)
    engine.weights = GptWeights(shape, device, torch.bfloat16)
    return engine


def check_kv_engine_bf16(pctx, device: torch.device, workdir: Path) -> tuple[list, ModelConfig]:
    import transformers

    from slurm_align.models.weights import local_tensors

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, bos_token_id=None, eos_token_id=None))
    folder = workdir / "llama"
    hf.save_pretrained(folder)
    cfg = ModelConfig(hf_path=str(folder), max_seq_len=64)
    chunks = megatron_model(cfg, pctx, device)
    shape = GptShape.from_model_config(cfg)
    engine = bf16_engine(shape, device)
    engine.refit({n: t.detach() for n, t in local_tensors(chunks, pctx)})
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, LLAMA["vocab_size"], (n,), generator=g) for n in (5, 9, 3, 12)]
    new = 16
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=new, temperature=0.0)).response_tokens
    # The exact reference: the same weights in float32. bf16 is an approximation on both sides, so a
    # token where our bf16 choice differs from transformers' bf16 choice is a near-tie when the two
    # tokens' float32 logits differ by less than transformers' own bf16 error at that position
    # (seen on an H200: gaps of 0.25-0.31 between two bf16 implementations of the same model).
    exact = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    hf = hf.to(device, torch.bfloat16).eval()
    # Teacher-forced: transformers scores our greedy responses in one forward; at every response
    # position our token must be its argmax, or a near-tie (above) that the two implementations may
    # break differently; a greedy run would diverge after it, teacher forcing does not.
    equal, ties, mismatch = 0, 0, []
    for i, p in enumerate(prompts):
        seq = torch.cat([p, ours[i]]).unsqueeze(0).to(device)
        window = slice(p.numel() - 1, p.numel() - 1 + new)
        with torch.no_grad():
            logits = hf(seq).logits[0, window].float().cpu()
            ref = exact(seq).logits[0, window].float().cpu()
        for t in range(new):
            mine, its = int(ours[i, t]), int(logits[t].argmax())
            bf16_error = float((logits[t] - ref[t]).abs().max())
            exact_gap = float(ref[t, its] - ref[t, mine])
            if mine == its:
                equal += 1
            elif exact_gap <= 2 * bf16_error:
                ties += 1
            else:
                mismatch.append((i, t, mine, its, round(exact_gap, 3), round(bf16_error, 3)))
    ok = not mismatch and equal >= 0.9 * len(prompts) * new
    report("kv_engine_bf16", "OK" if ok else "FAIL",
           f"{equal} of {len(prompts) * new} greedy tokens are transformers {transformers.__version__}'s argmax in "
           f"bf16 on {device}, {ties} near-ties (float32 gap <= 2x its bf16 error); "
           f"mismatches (prompt, step, ours, its, float32 gap, bf16 error) {mismatch}")
    return chunks, cfg


def greedy(engine: KVCacheEngine, prompts: list[torch.Tensor], new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens and their log-probs (temperature 1's: the logits' own) for `prompts`."""
    out = engine.generate(prompts, SamplingParams(max_new_tokens=new, temperature=0.0, return_logprobs=True))
    return out.response_tokens.cpu(), out.logprobs.float().cpu()


def check_refit(chunks, pctx, cfg: ModelConfig, device: torch.device) -> None:
    """An engine refitted from changed training weights generates exactly what a fresh engine
    given only the new weights generates (same tokens, same log-probs), and not what it
    generated before: a refit that keeps any old tensor, or does nothing, fails."""
    from slurm_align.models.forward import forward_logits
    from slurm_align.models.weights import local_tensors

    shape = GptShape.from_model_config(cfg)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (7, 4, 11)]
    new = 12
    engine = bf16_engine(shape, device)
    engine.refit({n: t.detach() for n, t in local_tensors(chunks, pctx)})
    old_tokens, old_lp = greedy(engine, prompts, new)
    with torch.no_grad():  # "training" changed every weight matrix (norm weights, all ones, keep their value)
        for c in chunks:
            for p in c.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * 0.5 * float(p.std()))
    sync(device)
    t0 = time.perf_counter()
    engine.refit({n: t.detach() for n, t in local_tensors(chunks, pctx)})
    sync(device)
    FIGURES["refit_s"] = time.perf_counter() - t0
    tokens, lp = greedy(engine, prompts, new)
    fresh = bf16_engine(shape, device)
    fresh.refit({n: t.detach() for n, t in local_tensors(chunks, pctx)})
    want_tokens, want_lp = greedy(fresh, prompts, new)
    # tokens exactly; log-probs to 1e-3 (two engines, same kernels: equal unless a GPU library
    # picks another reduction order; a stale tensor moves them by far more)
    same_as_fresh = torch.equal(tokens, want_tokens) and float((lp - want_lp).abs().max()) <= 1e-3
    changed = int((tokens != old_tokens).sum())
    lp_moved = float((lp - old_lp).abs().max())
    # and the engine's first token is the training model's argmax (or a bf16 near-tie of it)
    logits = forward_logits(chunks, pctx, prompts[0].unsqueeze(0).to(device), cfg.vocab_size)[0, -1].float()
    top2 = logits.topk(2)
    tie = near_tie(top2.values)
    agrees = tie or int(tokens[0, 0]) == int(top2.indices[0])
    ok = same_as_fresh and changed > 0 and lp_moved > 0.1 and agrees
    report("refit", "OK" if ok else "FAIL",
           f"refit {FIGURES['refit_s'] * 1e3:.1f} ms; after it the engine's greedy tokens and log-probs "
           f"{'equal' if same_as_fresh else 'DIFFER FROM'} a fresh engine's on the new weights; {changed} of "
           f"{tokens.numel()} tokens changed by the refit (must be > 0), log-probs moved by up to {lp_moved:.3f} "
           f"(must be > 0.1); first token {int(tokens[0, 0])} vs training argmax {int(top2.indices[0])}"
           + (" (a bf16 tie)" if tie else ""))


def check_grpo_step(chunks, pctx, cfg: ModelConfig, device: torch.device) -> None:
    from slurm_align.algorithms.advantages import grpo
    from slurm_align.models.forward import model_inputs, token_logprobs
    from slurm_align.models.weights import local_tensors

    shape = GptShape.from_model_config(cfg)
    engine = bf16_engine(shape, device)
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    n_prompts, group, new = 4, 4, 12
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g) for n in torch.randint(3, 8, (n_prompts,),
                                                                                                 generator=g)]
    rows = [p for p in prompts for _ in range(group)]

    def batch_logprobs(tokens, plen, rlen):
        out = chunks[0](**model_inputs(tokens))
        lp = token_logprobs(out, tokens, cfg.vocab_size)  # [b, s-1]
        pos = torch.arange(tokens.shape[1] - 1, device=device).unsqueeze(0)
        mask = (pos >= (plen - 1).unsqueeze(1)) & (pos < (plen - 1 + rlen).unsqueeze(1))
        return lp, mask.float()

    sync(device)
    t0 = time.perf_counter()
    engine.refit({n: t.detach() for n, t in local_tensors(chunks, pctx)})
    out = engine.generate(rows, SamplingParams(max_new_tokens=new, temperature=1.0), seeds=list(range(len(rows))))
    responses = out.responses()
    reward = torch.tensor([float((r % 2 == 0).float().mean()) for r in responses])  # rule: share of even ids
    groups = torch.arange(n_prompts).repeat_interleave(group)
    adv = grpo(reward, groups).to(device)
    seqs = [torch.cat([p, r]) for p, r in zip(rows, responses)]
    tokens = torch.zeros(len(seqs), max(s.numel() for s in seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : s.numel()] = s
    tokens = tokens.to(device)
    plen = torch.tensor([p.numel() for p in rows], device=device)
    rlen = torch.tensor([r.numel() for r in responses], device=device)
    for c in chunks:
        c.train()
    lp, mask = batch_logprobs(tokens, plen, rlen)
    before = ((lp.detach() * mask).sum(1) / mask.sum(1).clamp(min=1))
    loss = -((adv.unsqueeze(1) * lp * mask).sum() / mask.sum())
    opt.zero_grad()
    loss.backward()
    opt.step()
    sync(device)
    FIGURES["grpo_step_s"] = time.perf_counter() - t0
    with torch.no_grad():
        lp2, _ = batch_logprobs(tokens, plen, rlen)
    after = ((lp2 * mask).sum(1) / mask.sum(1).clamp(min=1))
    gain = after - before
    up, down = gain[adv > 0].mean(), gain[adv < 0].mean()
    ok = bool(torch.isfinite(loss)) and bool((adv != 0).any()) and float(up) > float(down)
    report("grpo_step", "OK" if ok else "FAIL", f"step {FIGURES['grpo_step_s']:.3f} s; mean log-prob change "
           f"{float(up):+.4f} (advantage > 0) vs {float(down):+.4f} (advantage < 0)")


def measure_tok_s(device: torch.device) -> None:
    shape = GptShape(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, vocab_size=512,
                     padded_vocab_size=512, max_seq_len=256)
    from slurm_align.generation.weights import expected_shapes

    g = torch.Generator().manual_seed(1)
    engine = bf16_engine(shape, device)
    engine.refit({k: torch.randn(s, generator=g) * 0.05 for k, s in expected_shapes(shape).items()})
    prompts = [torch.randint(0, 512, (int(n),), generator=g) for n in torch.randint(8, 64, (32,), generator=g)]
    params = SamplingParams(max_new_tokens=128, temperature=1.0)
    engine.generate(prompts, params)  # warm-up (kernels, cache allocation)
    sync(device)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    sync(device)
    FIGURES["torch_gpu_tok_s"] = float(out.response_lengths.sum()) / (time.perf_counter() - t0)
    print(f"torch KV-cache engine, bf16 on {device}: {FIGURES['torch_gpu_tok_s']:,.0f} tokens/s "
          f"(32 prompts x 128 new tokens, W1 shape)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("no GPU: torch.cuda.is_available() is False", flush=True)
            return 3
        torch.cuda.set_device(device.index or 0)
        print(f"torch {torch.__version__} CUDA {torch.version.cuda} on {torch.cuda.get_device_name()}", flush=True)
    from slurm_align.parallel.layout import initialize_model_parallel

    env = SoloEnv(device)
    pctx = initialize_model_parallel(env, 1, 1)
    with tempfile.TemporaryDirectory() as tmp:
        steps = [("nccl", lambda: check_nccl(device)), ("megatron_local", lambda: check_megatron_local(pctx, device)),
                 ("megatron_te", lambda: check_megatron_te(device))]
        for name, fn in steps:
            try:
                fn()
            except Exception:
                report(name, "FAIL", traceback.format_exc(limit=6))
        try:
            chunks, cfg = check_kv_engine_bf16(pctx, device, Path(tmp))
        except Exception:
            report("kv_engine_bf16", "FAIL", traceback.format_exc(limit=6))
            chunks = None
        for name, fn in (("refit", check_refit), ("grpo_step", check_grpo_step)):
            if chunks is None:
                report(name, "FAIL", "no model (kv_engine_bf16 failed)")
                continue
            try:
                fn(chunks, pctx, cfg, device)
            except Exception:
                report(name, "FAIL", traceback.format_exc(limit=6))
        try:
            measure_tok_s(device)
        except Exception:
            print(f"tokens/s not measured: {traceback.format_exc(limit=4)}", flush=True)
    failed = [n for n, s in RESULTS.items() if s == "FAIL"]
    if args.out is not None:
        args.out.write_text(json.dumps({"results": RESULTS, "figures": FIGURES}, indent=1))
    fmt = {k: ("NA" if v is None else f"{v:.0f}" if k.endswith("tok_s") else f"{v:.4f}") for k, v in FIGURES.items()}
    print(" ".join(f"{k}={v}" for k, v in fmt.items()), flush=True)
    os.environ.pop("MASTER_PORT", None)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
