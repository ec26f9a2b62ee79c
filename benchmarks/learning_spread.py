"""The learning tests under several float paths: does each verdict hold on any machine of this kind?

    PYTHONPATH=$PWD .venv/bin/python benchmarks/learning_spread.py [--paths avx2,default] [--tests grpo,ppo]
                                                                   [--out DIR]

A new machine gives other float results than the one a test was written on: other CPU kernels
(AVX2 against AVX-512), so every run takes another trajectory. Two libraries pick their kernels
from the CPU at start, and a path forces both: ATen's own (elementwise, softmax, norms:
`ATEN_CPU_CAPABILITY`) and MKL's matrix products (`MKL_ENABLE_INSTRUCTIONS`; oneDNN's
`ONEDNN_MAX_CPU_ISA` too). Measured: ATEN_CPU_CAPABILITY alone leaves every matmul bit-identical
(MKL still runs AVX-512), so `avx2` sets all three, as an AVX2-only host would; `aten-avx2` and
`aten-default` are the ATen-only variants. For each float path this runs the learning tests
(tests/integration/test_grpo.py, tests/integration/test_ppo.py: each a good run and its broken twin, from an SFT policy
and reward model built in the same session, so under the same path) in one pytest session, reads
the verdict line each test prints (tests/support/learning.py) and tabulates, per test and path:
the start, end and twin
end accuracies (PPO: mean rewards), the counts b (wrong -> right) and c (right -> wrong) of each
comparison and its p-value, the smallest b that would still pass (the bound) and whether the
test passed. A test whose p-value misses alpha under any path is not done.

The last line is the summary. Each path is a whole test session (about 10 minutes on a 2-core
machine at rest): run it in the background (nohup ... &). Run directories are kept under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from slurm_align import REPO_ROOT
from slurm_align.analysis.significance import sign_test
from tests.support.learning import ALPHA, TWIN_ALPHA, VERDICT_PREFIX

GRPO = "tests/integration/test_grpo.py::test_raises_heldout_accuracy_and_its_broken_twin_does_not"
TESTS = {
    "grpo": f"{GRPO}[grpo]",
    "rloo": f"{GRPO}[rloo]",
    "reinforce_pp_bf16": f"{GRPO}[reinforce_pp_bf16]",
    "rejection_sampling": f"{GRPO}[rejection_sampling]",
    "grpo_lora": f"{GRPO}[grpo_lora]",
    "grpo_async": "tests/integration/test_grpo.py::"
                  "test_async_example_learns_as_grpo_tiny_does_and_its_broken_twin_does_not",
    "ppo": "tests/integration/test_ppo.py::"
           "test_ppo_raises_its_reward_with_every_switch_off_and_a_flipped_advantage_does_not",
}
PATHS = {
    "native": {},                                                     # this CPU's best kernels
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
}
"""Float paths: the environment each forces on every process of the session (ranks inherit it).
`avx2` is an AVX2-only host (the issue's failing machine), `default` one without AVX at all."""
FORCED = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def loop_seconds() -> float:
    t = time.perf_counter()
    for _ in range(10 ** 7):
        pass
    return time.perf_counter() - t


def run_session(path: str, nodeids: list[str], out: Path) -> tuple[list[dict], dict[str, str], float]:
    """One pytest session of the learning tests under float path `path`: the verdict records, each
    test's outcome (passed/failed/error/skipped) and the wall seconds."""
    env = {k: v for k, v in os.environ.items() if k not in FORCED}
    env.update(PYTHONPATH=str(REPO_ROOT), SLURM_ALIGN_GRPO_FAMILY="1", **PATHS[path])   # the opt-in learning tests too
    folder = out / path
    folder.mkdir(parents=True, exist_ok=True)
    xml = folder / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-s", "-q",
           f"--basetemp={folder / 'tmp'}", f"--junitxml={xml}", *nodeids]
    t0 = time.time()
    with open(folder / "pytest.log", "w") as log:
        subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.time() - t0
    text = (folder / "pytest.log").read_text()
    records = [json.loads(line[line.index(VERDICT_PREFIX) + len(VERDICT_PREFIX):])
               for line in text.splitlines() if VERDICT_PREFIX in line]
    outcomes: dict[str, str] = {}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = case.get("name", "")
            state = "passed"
            for tag in ("failure", "error", "skipped"):
                if case.find(tag) is not None:
                    state = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
            outcomes[name] = state
    return records, outcomes, wall


def needed_b(b: int, c: int) -> int:
    """The smallest count of wrong -> right that passes at ALPHA with the same changed prompts."""
    n = b + c
    return next((k for k in range(n + 1) if sign_test(k, n - k) < ALPHA), n + 1)


def rows_of(record: dict, path: str) -> list[str]:
    g, o, t = record["gain"], record["over_twin"], record["twin"]
    if "b" in g:   # held-out accuracy: paired sign tests
        def part(c: dict) -> str:
            return f"b={c['b']:4d} c={c['c']:4d} p={c['p_better']:.1e} (b>={needed_b(c['b'], c['c'])})"
        ends = f"{g['acc_before']:.3f} {g['acc_after']:.3f} {o['acc_before']:.3f}"
        return [record["test"], path, ends, part(g), part(o),
                f"b={t['b']:4d} c={t['c']:4d} p={t['p_better']:.2f}"]

    def part_r(r: dict) -> str:   # rewards: rank-sum tests
        return f"2U={r['u2']}/{r['pairs2']} p={r['p_better']:.1e}"
    ends = f"{g['mean_before']:+.2f} {g['mean_after']:+.2f} {o['mean_before']:+.2f}"
    return [record["test"], path, ends, part_r(g), part_r(o), f"p={t['p_better']:.2f}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="avx2,default", help=f"comma-separated, of {', '.join(PATHS)}")
    ap.add_argument("--tests", default=",".join(TESTS), help=f"comma-separated, of {', '.join(TESTS)}")
    ap.add_argument("--out", type=Path, default=Path("runs/learning-spread"))
    args = ap.parse_args()
    paths = args.paths.split(",")
    names = args.tests.split(",")
    for p in paths:
        if p not in PATHS:
            ap.error(f"--paths: {p!r} is not one of {', '.join(PATHS)}")
    for n in names:
        if n not in TESTS:
            ap.error(f"--tests: {n!r} is not one of {', '.join(TESTS)}")
    out = args.out.resolve()
    print(f"10^7-step Python loop: {loop_seconds():.2f} s", flush=True)
    table: list[list[str]] = []
    failures: list[str] = []
    worst = {"a": 0.0, "b": 0.0, "c": 1.0}
    for path in paths:
        records, outcomes, wall = run_session(path, [TESTS[n] for n in names], out)
        print(f"float path {path}: {len(records)} verdicts, {wall:.0f} s of pytest "
              f"(10^7-step loop now {loop_seconds():.2f} s); log {out / path / 'pytest.log'}", flush=True)
        for record in records:
            table.append(rows_of(record, path))
            if record.get("versus"):   # the async example against grpo_tiny's end: prompts lost net
                v = record["versus"]
                table.append([f"{record['test']} vs grpo", path, f"{v['acc_before']:.3f} -> {v['acc_after']:.3f}",
                              f"b={v['b']} c={v['c']}: c-b={v['c'] - v['b']} (at most {0.05 * v['n']:.0f})", "", ""])
            worst["a"] = max(worst["a"], record["gain"]["p_better"])
            worst["b"] = max(worst["b"], record["over_twin"]["p_better"])
            worst["c"] = min(worst["c"], record["twin"]["p_better"])
        for name, state in sorted(outcomes.items()):
            if state != "passed":
                failures.append(f"{name} under {path}: {state}")
        missing = [n for n in names if not any(TESTS[n].split("::")[-1] == k for k in outcomes)]
        failures += [f"{n} under {path}: no result (see the log)" for n in missing]
    header = ["test", "float path", "start end twin-end", "(a) start->end", "(b) twin-end->end", "(c) twin start->end"]
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    print()
    for r in [header, *table]:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    print(f"bound: (a) and (b) p < {ALPHA} (b>=K: the fewest wrong->right prompts that pass with the same changed "
          f"prompts), (c) p > {TWIN_ALPHA}")
    verdict = "ALL PASS" if not failures else "NOT DONE: " + "; ".join(failures)
    print(f"learning spread: {len(names)} tests x {len(paths)} float paths ({', '.join(paths)}): "
          f"largest p(a) {worst['a']:.1e}, largest p(b) {worst['b']:.1e}, smallest p(c) {worst['c']:.2f}; {verdict}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
