"""Data start-up per rank: the eager path (every rank tokenizes the whole prompt set before the
first step, as PromptDataset did before issue 39) against the lazy one (it reads the rows and
tokenizes only the prompts it generates from in the first step), for 1k, 100k and 1M prompts,
as JSONL and as parquet; and the login node's check (read every row, tokenize a sample).

Each measurement runs in a fresh process (its peak RSS is the rank's memory): read the data set,
then encode the first step's share of one of 8 DP ranks (grpo_tiny: 32 prompts per step), or,
eager, every prompt.

    .venv/bin/python benchmarks/bench_data.py [--sizes 1000,100000,1000000] [--ranks 8]

Last line: startup_1m_over_1k= (lazy, parquet) rank_rss_1m_mib= (lazy, parquet).

Measured on this project's 2-core machine under load ~25 (10^7-step loop 0.47 s), seconds and
peak MiB per rank: 1M prompts, parquet: eager 38.1 s / 1209 MiB, lazy 15.5 s / 1077 MiB, the
login node's check 25.6 s; JSONL: eager 52.4 s, lazy 35.9 s, check 44.8 s. The rest of the cost
is reading and validating every row into Python objects on every rank (not yet lazy), so
startup_1m_over_1k=4.7 (a 1k set is dominated by pyarrow's import) and rank_rss_1m_mib=1077.
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
    else:
        ds = PromptDataset(path, tok, run.model.max_seq_len)
        prompts = ds.token_arrays()
        if mode == "eager":
            used = prompts[:]
        else:   # this rank's share of step 1's prompts (a strided share, as the static shards give)
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
    pq.write_table(pa.table({"prompt": prompts}), parquet)
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
        print(f"{'prompts':>9} {'format':>8} {'eager s':>8} {'lazy s':>8} {'submit s':>9} "
              f"{'eager MiB':>10} {'lazy MiB':>9}")
        for n in sizes:
            for fmt, path in write(Path(tmp), n).items():
                row = {mode: measure(path, mode, args.ranks) for mode in ("eager", "lazy", "submit")}
                results.update({(n, fmt, m): r for m, r in row.items()})
                e, z, s = row["eager"], row["lazy"], row["submit"]
                print(f"{n:>9} {fmt:>8} {e['seconds']:>8.2f} {z['seconds']:>8.2f} {s['seconds']:>9.2f} "
                      f"{e['rss_mib']:>10.0f} {z['rss_mib']:>9.0f}", flush=True)
    small, big = min(sizes), max(sizes)
    ratio = results[big, "parquet", "lazy"]["seconds"] / results[small, "parquet", "lazy"]["seconds"]
    print(f"startup_{big // 1000}k_over_{small // 1000}k={ratio:.1f} rank_rss_{big // 1000}k_mib="
          f"{results[big, 'parquet', 'lazy']['rss_mib']:.0f}".replace("1000k", "1m"))


if __name__ == "__main__":
    main()
