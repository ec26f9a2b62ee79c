"""Data start-up per rank: the old path (every rank reads every row into Python objects and
tokenizes the whole prompt set before the first step, as PromptDataset did before issue 39)
against the new one (the data set opens without reading rows: a JSONL line index, parquet row
groups, and the rank reads and tokenizes only the prompts it generates from in the first
step), for 1k, 100k and 1M prompts, as JSONL and as parquet (row groups of 10,000 rows); and the
login node's check (schema + a 2,000-row sample), new path.

Each measurement runs in a fresh process (its peak RSS is the rank's memory, imports included):
open the data set, then encode the first step's share of one of 8 DP ranks (grpo_tiny: 32
prompts per step), or, old, read and encode every prompt.

    .venv/bin/python benchmarks/bench_data.py [--sizes 1000,100000,1000000] [--ranks 8]

Last line: startup_1m_over_1k= (new path, parquet: 1M prompts' start-up over 1k's)
rank_rss_1m_mib= (new path, parquet, 1M prompts).

Measured on this project's 2-core machine under load ~96 (10^7-step loop 0.57 s), seconds and
peak MiB per rank, old / new / login node's check: 1M prompts, parquet 83.6 s / 0.24 s / 0.52 s,
1116 / 324 / 326 MiB; JSONL 82.4 s / 1.17 s / 0.88 s, 1072 / 355 / 354 MiB; 100k parquet
17.5 s / 0.87 s; 1k parquet 2.66 s / 0.49 s (the first parquet read's own start-up). The new
path's memory is the imports' (~275 MiB for torch and the tokenizer) plus the 24-byte-per-line
index (JSONL) or the row groups read. startup_1m_over_1k=0.5 rank_rss_1m_mib=324.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(path: str, mode: str, ranks: int) -> None:
    """One rank's start-up (or the login node's check), timed; prints a JSON line."""
    sys.path.insert(0, str(ROOT))
    from slurm_align.algorithms.rollout_collector import prompt_order
    from slurm_align.config import load_run_config
    from slurm_align.config.loading import check_prompt_lengths
    from slurm_align.data.datasets import PromptDataset
    from slurm_align.models.tokenizer import build_tokenizer

    run = load_run_config(ROOT / "examples" / "grpo_tiny.yaml", [f"data.train_path={path}"])
    tok = build_tokenizer(run.model)
    t0 = time.perf_counter()
    if mode == "submit":
        check_prompt_lengths(run, Path(path))
    elif mode == "old":   # every row read and validated, every prompt tokenized, on every rank
        from slurm_align.data.datasets import encode_prompt
        from slurm_align.data.jsonl import read_rows
        used = [encode_prompt(tok, r.data["prompt"], run.model.max_seq_len) for r in read_rows(path, "prompt")]
        assert used
    else:   # this rank's share of step 1's prompts (a strided share, as the static shards give)
        prompts = PromptDataset(path, tok, run.model.max_seq_len, reserve=run.generation.max_new_tokens).token_arrays()
        order = prompt_order(run, len(prompts), 1)
        used = [prompts[int(i)] for i in order[::ranks]]
        assert used
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def measure(path: Path, mode: str, ranks: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(path), mode, str(ranks)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def write(folder: Path, n: int) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    prompts = [f"{i % 100000:05d}=" for i in range(n)]
    jsonl, parquet = folder / f"p{n}.jsonl", folder / f"p{n}.parquet"
    jsonl.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    pq.write_table(pa.table({"prompt": prompts}), parquet, row_group_size=10_000)
    return {"jsonl": jsonl, "parquet": parquet}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1000,100000,1000000")
    ap.add_argument("--ranks", type=int, default=8)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    t = time.perf_counter()
    for _ in range(10**7):
        pass
    print(f"10^7-step Python loop: {time.perf_counter() - t:.2f} s")
    results: dict[tuple[int, str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'prompts':>9} {'format':>8} {'old s':>8} {'new s':>8} {'submit s':>9} "
              f"{'old MiB':>8} {'new MiB':>8} {'submit MiB':>10}")
        for n in sizes:
            for fmt, path in write(Path(tmp), n).items():
                row = {mode: measure(path, mode, args.ranks) for mode in ("old", "new", "submit")}
                results.update({(n, fmt, m): r for m, r in row.items()})
                o, z, s = row["old"], row["new"], row["submit"]
                print(f"{n:>9} {fmt:>8} {o['seconds']:>8.2f} {z['seconds']:>8.2f} {s['seconds']:>9.2f} "
                      f"{o['rss_mib']:>8.0f} {z['rss_mib']:>8.0f} {s['rss_mib']:>10.0f}", flush=True)
    small, big = min(sizes), max(sizes)
    ratio = results[big, "parquet", "new"]["seconds"] / results[small, "parquet", "new"]["seconds"]
    print(f"startup_{big // 1000}k_over_{small // 1000}k={ratio:.1f} rank_rss_{big // 1000}k_mib="
          f"{results[big, 'parquet', 'new']['rss_mib']:.0f}".replace("1000k", "1m"))


if __name__ == "__main__":
    main()
