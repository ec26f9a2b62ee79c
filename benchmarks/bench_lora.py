"""Full fine-tuning against LoRA rank 8 on one PPO/GRPO actor rank: peak memory (RSS), optimizer
state bytes and step time.

A Llama-shaped model of about 100M parameters (12 layers, hidden 768, 12 heads, 4 KV groups,
SwiGLU 2048, vocab 16384, untied) on one rank (a world of one, CPU float32). Each mode runs in
its own process (peak RSS is per process) and does what an actor rank does around its update:
builds the policy, its reference (full: HostSwap's host copy of every weight; LoRA: the same
model with adapters off) and AdamW over the trainable parameters; then per step the policy's
and the reference's log-probs of a rollout batch (forward_logprobs, reference swapped in), a
policy-gradient loss (advantage x log-prob over the response tokens) through megatron's
forward/backward schedule in micro-batches, and the trainers' optimizer_step. Step time is the
mean over the steps after the first (AdamW's state is created in the first).
Last line: lora_over_full_optimizer_bytes= lora_over_full_peak_rss= lora_over_full_step_s=.

    python benchmarks/bench_lora.py [--steps 3] [--batch 4] [--seq 64] [--micro-batch 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

SHAPE = dict(num_layers=12, hidden_size=768, num_attention_heads=12, num_query_groups=4, ffn_hidden_size=2048,
             vocab_size=16384, max_seq_len=256, position_embedding="rope", normalization="RMSNorm",
             activation="swiglu", add_bias_linear=False)


def measure(mode: str, steps: int, batch: int, seq: int, micro: int) -> dict:
    """One mode in this process: the numbers, as a dict."""
    import torch
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    from slurm_align.config.run import ModelConfig
    from slurm_align.models.forward import forward_logprobs, run_schedule, sequence_token_logprobs
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.lora import attach_configured, reference_policy, trainable_parameters
    from slurm_align.models.optimizer import optimizer_step
    from slurm_align.models.packing import Batching
    from slurm_align.parallel.bootstrap import init_distributed
    from slurm_align.parallel.layout import initialize_model_parallel

    cfg = ModelConfig(**SHAPE, lora={"rank": 8, "alpha": 16} if mode == "lora" else None)
    pctx = initialize_model_parallel(init_distributed(), 1, 1)
    policy = build_gpt(cfg, pctx, seed=1)
    attach_configured(policy, cfg, pctx, seed=1)
    params = trainable_parameters(policy)
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    reference = reference_policy(policy)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    advantages = torch.randn(batch, generator=g)
    prompt = seq // 4   # response tokens: positions past the prompt
    batching = Batching(micro_batch_size=micro)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with torch.no_grad():
            forward_logprobs(policy, pctx, tokens, cfg.vocab_size, batching=batching)
            reference.swap()
            try:
                forward_logprobs(policy, pctx, tokens, cfg.vocab_size, batching=batching)
            finally:
                reference.swap()
        mbs = [{"tokens": tokens[i:i + micro], "adv": advantages[i:i + micro]} for i in range(0, batch, micro)]

        def loss_fn(output, mb):
            logp = sequence_token_logprobs(output, mb, cfg.vocab_size)[:, prompt - 1:]
            loss = -(mb["adv"][:, None] * logp).sum() / (batch * logp.shape[1]) * len(mbs)  # noqa: B023  (called in this iteration)
            return loss, {"loss": loss.detach()}

        optimizer.zero_grad(set_to_none=True)
        for c in policy:
            c.train()
        run_schedule(policy, mbs, loss_fn, forward_only=False)
        optimizer_step(optimizer, pctx, 1.0)
        times.append(time.perf_counter() - t0)
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                      for t in s.values() if isinstance(t, torch.Tensor))
    out = {"mode": mode, "parameters": sum(p.numel() for c in policy for p in c.parameters())
           + (sum(p.numel() for p in params) if mode == "lora" else 0),
           "trainable": sum(p.numel() for p in params), "optimizer_bytes": state_bytes,
           # ru_maxrss is in KiB on Linux
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "step_s": sum(times[1:]) / max(len(times) - 1, 1), "first_step_s": times[0]}
    pctx.destroy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="steps per mode (the first is not timed)")
    ap.add_argument("--batch", type=int, default=4, help="rollouts per step")
    ap.add_argument("--seq", type=int, default=64, help="tokens per rollout (prompt: the first quarter)")
    ap.add_argument("--micro-batch", type=int, default=2, help="rollouts per micro-batch")
    ap.add_argument("--mode", choices=("full", "lora"), help=argparse.SUPPRESS)   # the per-mode child
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args.steps, args.batch, args.seq, args.micro_batch)))
        return
    res = {}
    for mode in ("full", "lora"):
        cmd = [sys.executable, __file__, "--mode", mode, "--steps", str(args.steps), "--batch", str(args.batch),
               "--seq", str(args.seq), "--micro-batch", str(args.micro_batch)]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONWARNINGS="ignore", OMPI_ALLOW_RUN_AS_ROOT="1",
                                       OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
        if proc.returncode != 0:
            raise SystemExit(f"{mode} failed:\n{proc.stderr[-4000:]}")
        res[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = res[mode]
        print(f"{mode}: {r['parameters'] / 1e6:.1f}M parameters, {r['trainable'] / 1e6:.2f}M trainable, "
              f"optimizer state {r['optimizer_bytes'] / 2**20:.1f} MiB, "
              f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB, "
              f"step {r['step_s']:.2f} s", flush=True)
    full, lora = res["full"], res["lora"]
    print(f"lora_over_full_optimizer_bytes={lora['optimizer_bytes'] / full['optimizer_bytes']:.4f} "
          f"lora_over_full_peak_rss={lora['peak_rss_bytes'] / full['peak_rss_bytes']:.3f} "
          f"lora_over_full_step_s={lora['step_s'] / full['step_s']:.3f}")


if __name__ == "__main__":
    main()
