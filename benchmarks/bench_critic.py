"""Critic over PyTriton: round trip and throughput of W1-sized micro-batches, and how much of
the critic's compute hides behind the actor's own log-prob computation (async futures).

    python benchmarks/bench_critic.py [--micro-batches 8] [--port P]

W1 micro-batch: 32 sequences x 192 tokens; critic and actor models: GPT 4 layers, hidden 256,
4 heads, vocab 512. The critic runs as a real server process (launchers/critic.py, one rank);
the actor is this process (one rank, megatron-core policy forward for log-probs).
Figures, measured side by side in one run:
    rtt_ms            median round trip of one critic_infer (includes the critic's compute)
    transport_ms      rtt minus the critic's compute (timed by the server: compute_ms output)
    mib_per_s         request + response bytes over transport_ms
    wait_over_critic  actor time blocked on critic futures / critic compute time (target <= 0.2);
                      the actor computes policy and reference log-probs meanwhile
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from tests.support.critic_support import CriticProcess, free_port_triple, write_run_dir

MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 512, "max_seq_len": 256}
B, T = 32, 192


def actor_logprobs(models, pctx, tokens: np.ndarray) -> list[torch.Tensor]:
    """What the actor does while the critic works: policy and reference log-probs."""
    from slurm_align.models.forward import forward_logits
    tok = torch.from_numpy(tokens)
    out = []
    for chunks in models:
        logits = forward_logits(chunks, pctx, tok, MODEL["vocab_size"])
        out.append(torch.log_softmax(logits[:, :-1], -1).gather(-1, tok[:, 1:, None]).squeeze(-1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from slurm_align.config.run import ModelConfig
    from slurm_align.critic.client import CriticClient
    from slurm_align.models.gpt import build_gpt
    from slurm_align.parallel.bootstrap import init_distributed
    from slurm_align.parallel.layout import initialize_model_parallel

    port = args.port or free_port_triple()
    run_dir = write_run_dir(Path(tempfile.mkdtemp(prefix="bench-critic-")), port=port, model=MODEL,
                            request_timeout_s=300)
    critic = CriticProcess(run_dir)
    try:
        env = init_distributed()
        pctx = initialize_model_parallel(env, 1, 1)
        actor = [build_gpt(ModelConfig(**MODEL), pctx, seed=s) for s in (1, 2)]  # policy, reference
        rng = np.random.default_rng(0)
        mbs = [(rng.integers(0, MODEL["vocab_size"], size=(B, T)), rng.integers(T // 2, T + 1, size=B))
               for _ in range(args.micro_batches)]
        client = CriticClient.for_run_dir(run_dir, connect_timeout_s=180, request_timeout_s=300)
        t0 = time.perf_counter()
        client.connect()
        print(f"critic ready after {time.perf_counter() - t0:.1f} s", flush=True)
        client.infer(*mbs[0])  # warm-up (first call allocates)
        actor_logprobs(actor, pctx, mbs[0][0])

        # 1. critic alone: synchronous round trips.
        rtts, computes = [], []
        for tok, ln in mbs:
            t = time.perf_counter()
            computes.append(client.infer(tok, ln, timing=True)[2] / 1e3)
            rtts.append(time.perf_counter() - t)
        critic_s = sum(computes)
        nbytes = B * T * 8 + B * 8 + B * T * 4 + B * 4
        # 2. actor alone.
        t = time.perf_counter()
        for tok, _ in mbs:
            actor_logprobs(actor, pctx, tok)
        actor_s = time.perf_counter() - t
        # 3. overlapped: send each micro-batch, compute its log-probs meanwhile, collect at the end.
        t = time.perf_counter()
        futures = []
        for tok, ln in mbs:
            futures.append(client.infer_async(tok, ln))
            actor_logprobs(actor, pctx, tok)
        tw = time.perf_counter()
        for f in futures:
            f.result()
        wait_s = time.perf_counter() - tw
        overlapped_s = time.perf_counter() - t
        client.shutdown_critic()
        client.close()
        critic.wait(timeout=60)
        pctx.destroy()
    finally:
        critic.stop()

    rtt = statistics.median(rtts)
    # Transport share of a round trip: its time beyond the critic's own compute (server-timed).
    transport = statistics.median(r - c for r, c in zip(rtts, computes))
    print(f"micro-batch {B}x{T}, {args.micro_batches} micro-batches, payload {nbytes / 2**20:.2f} MiB per round trip")
    print(f"critic alone   {critic_s:.2f} s compute (median rtt {rtt * 1e3:.1f} ms, of which transport "
          f"{transport * 1e3:.1f} ms)")
    print(f"actor alone    {actor_s:.2f} s")
    print(f"sequential sum {sum(rtts) + actor_s:.2f} s, overlapped {overlapped_s:.2f} s, "
          f"actor blocked on critic {wait_s:.2f} s")
    print(f"rtt_ms={rtt * 1e3:.1f} transport_ms={transport * 1e3:.1f} mib_per_s={nbytes / 2**20 / transport:.1f} "
          f"critic_s={critic_s:.2f} "
          f"actor_s={actor_s:.2f} overlapped_s={overlapped_s:.2f} "
          f"speedup={(sum(rtts) + actor_s) / overlapped_s:.2f} wait_over_critic={wait_s / critic_s:.3f}")


if __name__ == "__main__":
    main()
