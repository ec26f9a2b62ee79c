"""The step's save phase, synchronous against asynchronous (checkpointing.async_save), for the W1
model and a 10x larger one, side by side in one run.

On one rank (a world of one, CPU float32) the model and AdamW (its state made by one update) are
saved SAVES times into a fresh folder per mode, with STEP_S of other work between saves as in a
run (a sleep: the writer's threads and processes then have the cores the step would share). The
critical path of a save is what the step waits for: sync, the whole save_checkpoint (write,
metadata, manifest, rename); async, AsyncCheckpointWriter.save (a wait for the previous write,
megatron's planning and the host copy), the last write joined after the timing. The first save
of each mode is left out (imports, first-call set-up). Both modes' last checkpoints are checked
to hold the same tensors.
Last line: async_save_over_sync_critical_path= (the 10x model's medians).

    python benchmarks/bench_checkpoint.py [--saves 4] [--step-s 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

W1 = dict(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=512, max_seq_len=256)
TEN_X = dict(num_layers=4, hidden_size=832, num_attention_heads=8, vocab_size=512, max_seq_len=256)
"""About 10x W1's parameters (12 h^2 per layer: 33M against 3.1M, plus embeddings)."""


def build(shape: dict, pctx):
    import torch

    from slurm_align.config.run import ModelConfig
    from slurm_align.models.gpt import build_gpt

    cfg = ModelConfig(**shape)
    chunks = build_gpt(cfg, pctx, seed=1)
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for p in params:   # one update: AdamW's state exists, as in a run
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    return chunks, optimizer, sum(p.numel() for p in params)


def critical_path(mode: str, chunks, optimizer, root: Path, saves: int, step_s: float) -> list[float]:
    from slurm_align.models.checkpoint import AsyncCheckpointWriter, save_checkpoint

    writer = AsyncCheckpointWriter() if mode == "async" else None
    times, waits = [], []
    for step in range(1, saves + 1):
        t0 = time.perf_counter()
        if writer is None:
            save_checkpoint(root, step, chunks, optimizer, {"bench": mode})
        else:
            writer.wait()   # what save() does first: the previous write, if the step was shorter
            waits.append(time.perf_counter() - t0)
            writer.save(root, step, chunks, optimizer, {"bench": mode})
        times.append(time.perf_counter() - t0)
        time.sleep(step_s)
    if writer is not None:
        writer.wait()
        print(f"  async: of which waiting for the previous write: {', '.join(f'{w:.3f}' for w in waits[1:])}")
    return times[1:]


def same_tensors(a: Path, b: Path) -> bool:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = []
    for path in (a, b):
        target = path.parent / f"{path.parent.name}.pt"
        dcp_to_torch_save(str(path), str(target))
        out.append(torch.load(target, weights_only=False))
    keys = [k for k in out[0] if k != "common"]
    return keys == [k for k in out[1] if k != "common"] and all(
        torch.equal(x, y) for k in keys for x, y in [(out[0][k], out[1][k])] if isinstance(x, torch.Tensor))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=10.0, help="work between saves (a run saves every "
                    "save_interval steps: usually longer than a write)")
    args = ap.parse_args()
    from slurm_align.parallel.bootstrap import init_distributed
    from slurm_align.parallel.layout import initialize_model_parallel

    pctx = initialize_model_parallel(init_distributed(), 1, 1)
    ratio = float("nan")
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        for name, shape in (("W1", W1), ("10x W1", TEN_X)):
            chunks, optimizer, n = build(shape, pctx)
            medians = {}
            for mode in ("sync", "async"):
                root = Path(tmp) / name.replace(" ", "_") / mode
                times = critical_path(mode, chunks, optimizer, root, args.saves, args.step_s)
                medians[mode] = statistics.median(times)
                print(f"{name} ({n / 1e6:.1f}M parameters) {mode}: save phase {medians[mode]:.3f} s "
                      f"(median of {len(times)}: {', '.join(f'{t:.3f}' for t in times)})", flush=True)
            last = f"iter_{args.saves:07d}"
            equal = same_tensors(Path(tmp) / name.replace(" ", "_") / "sync" / last,
                                 Path(tmp) / name.replace(" ", "_") / "async" / last)
            ratio = medians["async"] / medians["sync"]
            print(f"{name}: async/sync critical path {ratio:.3f}; same tensors saved: {equal}", flush=True)
            if not equal:
                sys.exit(f"{name}: the async checkpoint's tensors differ from the sync one's")
    print(f"async_save_over_sync_critical_path={ratio:.3f}")


if __name__ == "__main__":
    main()
