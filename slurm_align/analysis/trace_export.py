"""Chrome trace (Perfetto / chrome://tracing) JSON from a span table.

One process per component, one thread per rank, one complete event (`ph: "X"`) per span with ts
and dur in microseconds since the run's first span; metadata events name processes and threads.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from slurm_align.config.run import COMPONENTS as COMPONENT_ORDER  # the declared order: actor, critic, generator
from slurm_align.rundir import write_atomic


def chrome_trace(spans: np.ndarray, run_name: str = "run") -> dict:
    comps = sorted(set(spans["component"].tolist()),
                   key=lambda c: (COMPONENT_ORDER.index(c) if c in COMPONENT_ORDER else 99, c))
    pid = {c: i + 1 for i, c in enumerate(comps)}
    t0 = int(spans["start_ns"].min()) if len(spans) else 0
    meta = []
    for comp in comps:
        meta.append({"ph": "M", "name": "process_name", "pid": pid[comp], "tid": 0, "ts": 0,
                     "args": {"name": comp}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid[comp], "tid": 0, "ts": 0,
                     "args": {"sort_index": pid[comp]}})
        for rank in sorted(set(spans["rank"][spans["component"] == comp].tolist())):
            meta.append({"ph": "M", "name": "thread_name", "pid": pid[comp], "tid": int(rank), "ts": 0,
                         "args": {"name": f"rank {rank}"}})
    events = []
    for s in spans[np.argsort(spans["start_ns"], kind="stable")]:
        events.append({
            "name": str(s["phase"]), "cat": str(s["component"]), "ph": "X",
            "ts": (int(s["start_ns"]) - t0) / 1e3, "dur": (int(s["end_ns"]) - int(s["start_ns"])) / 1e3,
            "pid": pid[str(s["component"])], "tid": int(s["rank"]), "args": {"step": int(s["step"])},
        })
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"run": run_name, "t0_unix_ns": t0}}


def write_chrome_trace(spans: np.ndarray, out: Path, run_name: str = "run") -> int:
    """Write the trace atomically; returns the number of span events."""
    trace = chrome_trace(spans, run_name)
    write_atomic(Path(out), json.dumps(trace, separators=(",", ":")))
    return sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
