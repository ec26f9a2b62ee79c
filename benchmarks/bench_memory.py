"""Memory of training, measured side by side in one run of 2 gloo ranks (DP 2), against the plan.

One GPT (4 layers, hidden 128, 4 heads, vocab 512, 128 tokens x 4 rows per micro-batch) built
several ways on each rank:

- optimizer state with the fp32 main weights, bytes per rank read from the optimizer's tensors:
  bf16 with ZeRO-1 over the 2 ranks against bf16 unsharded (what DP 1 holds);
- the model's weight bytes in bf16 against fp32;
- activations: the peak of the bytes autograd holds alive for the backward pass (distinct
  storages, parameters excluded, tracked through saved-tensor hooks as they are packed and
  freed, the recomputation in the backward pass included) with full recompute against none;
- the plan (config/memory_plan.py) against each measured number: the largest relative error;
- the time of one bf16 training step over fp32 (CPU bf16 is emulated on most CPUs: reported,
  not a goal).

Last line:

    zero1_optimizer_bytes_dp2_over_dp1= bf16_weight_bytes_over_fp32= recompute_activation_peak_ratio=
    plan_max_rel_error= bf16_step_over_fp32=

    python benchmarks/bench_memory.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

from slurm_align.config.memory_plan import activation_elements, plan_model  # noqa: E402
from slurm_align.config.run import ModelConfig, ParallelConfig, TrainingConfig  # noqa: E402
from slurm_align.profiling.activations import SavedActivationPeak  # noqa: E402

MODEL = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=512, max_seq_len=128)
ROWS, SEQ = 4, 128


def tokens() -> torch.Tensor:
    return torch.randint(0, MODEL.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))


def nll(logits: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
    lp = torch.log_softmax(logits[:, :-1, :MODEL.vocab_size].float(), -1)
    loss = -lp.gather(-1, mb["tokens"][:, 1:, None]).mean()
    return loss, {"loss": loss.detach()}


def step(chunks: list, opt=None, live: SavedActivationPeak | None = None) -> float:
    from slurm_align.models.forward import run_schedule
    t0 = time.perf_counter()
    if opt is not None:
        opt.zero_grad()
    if live is None:
        run_schedule(chunks, [{"tokens": tokens()}], nll, forward_only=False)
    else:
        with live:
            run_schedule(chunks, [{"tokens": tokens()}], nll, forward_only=False)
    if opt is not None:
        opt.step()
    return time.perf_counter() - t0


def state_bytes(opt) -> int:
    moments = sum(t.numel() * t.element_size() for st in opt.optimizer.state.values()
                  for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))
    return moments + sum(b.main.numel() * b.main.element_size() for b in opt.buckets)


def rank_program(out: Path) -> None:
    import torch.distributed as dist

    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.optimizer import build_optimizer
    from slurm_align.parallel.bootstrap import init_distributed
    from slurm_align.parallel.layout import initialize_model_parallel
    pctx = initialize_model_parallel(init_distributed(), 1, 1)
    par = ParallelConfig(data_parallel=pctx.dp_size)
    results: dict[str, float] = {}
    errors = []

    def built(t: TrainingConfig):
        chunks = build_gpt(MODEL, pctx, seed=3, training=t)
        return chunks, build_optimizer([p for c in chunks for p in c.parameters()], pctx, t, lr=1e-3)

    # optimizer state per rank, and the step time of each precision (best of 3 after one)
    times, sizes, weights = {}, {}, {}
    for name, t in {"fp32": TrainingConfig(), "bf16": TrainingConfig(precision="bf16"),
                    "bf16_zero1": TrainingConfig(precision="bf16", distributed_optimizer=True)}.items():
        chunks, opt = built(t)
        times[name] = min(step(chunks, opt) for _ in range(4))
        sizes[name] = state_bytes(opt)
        weights[name] = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
        plan = plan_model("m", MODEL, par, t)
        errors.append(abs(plan.main_weights + plan.optimizer - sizes[name]) / sizes[name] if sizes[name] else 0.0)
        errors.append(abs(plan.weights - weights[name]) / weights[name])
    results["zero1_optimizer_bytes_dp2_over_dp1"] = sizes["bf16_zero1"] / sizes["bf16"]
    results["bf16_weight_bytes_over_fp32"] = weights["bf16"] / weights["fp32"]
    results["bf16_step_over_fp32"] = times["bf16"] / times["fp32"]

    # activations: peak held for backward, full recompute vs none (fp32), against the plan
    peaks = {}
    for mode in ("none", "selective", "full"):
        chunks = build_gpt(MODEL, pctx, seed=3, training=TrainingConfig(recompute=mode))
        live = SavedActivationPeak(p for c in chunks for p in c.parameters())
        step(chunks, live=live)
        peaks[mode] = live.peak
        planned = 4 * activation_elements(MODEL, 1, 1, ROWS * SEQ, ROWS, mode)
        errors.append(abs(planned - live.peak) / live.peak)
        if dist.get_rank() == 0:
            print(f"activations {mode}: peak {live.peak:,} B, planned {planned:,} B", flush=True)
    results["recompute_activation_peak_ratio"] = peaks["full"] / peaks["none"]
    results["plan_max_rel_error"] = max(errors)
    if dist.get_rank() == 0:
        print(f"optimizer state + main weights per rank (B): {sizes}", flush=True)
        print(f"weights (B): {weights}; activation peaks (B): {peaks}; step s: {times}", flush=True)
        print(" ".join(f"{k}={results[k]:.4g}" for k in (
            "zero1_optimizer_bytes_dp2_over_dp1", "bf16_weight_bytes_over_fp32", "recompute_activation_peak_ratio",
            "plan_max_rel_error", "bf16_step_over_fp32")), flush=True)
    dist.barrier()
    pctx.destroy()


def main() -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["mpirun", "--oversubscribe", "-n", "2", sys.executable, __file__, "--rank-program", tmp]
        return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    if "--rank-program" in sys.argv:
        rank_program(Path(sys.argv[-1]))
    else:
        sys.exit(main())
