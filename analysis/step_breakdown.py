"""Step-time breakdown of a run, for scripts and notebooks (same numbers as `slurm-align analyze breakdown`).

    python analysis/step_breakdown.py RUN_DIR [MORE_RUN_DIRS...]

In a notebook:
    from slurm_align.analysis.runs import load_run
    from slurm_align.analysis.breakdown import compute_breakdown
    b = compute_breakdown(load_run("runs/run-...").spans)
    b.phases, b.phase_s, b.step_s, b.idle_s   # numpy arrays, seconds
"""

import json
import sys

from slurm_align.analysis.breakdown import compute_breakdown
from slurm_align.analysis.plots import plot_breakdown
from slurm_align.analysis.runs import load_run

if __name__ == "__main__":
    runs = [load_run(p, allow_incomplete=True) for p in sys.argv[1:]]
    bs = [compute_breakdown(r.spans, name=r.name) for r in runs]
    for b in bs:
        print(json.dumps({"run": b.name, "mean_step_s": b.mean_step_s,
                          "share": dict(zip(b.phases, b.share.round(3).tolist()))}))
    print("chart:", plot_breakdown(bs, runs[0].run_dir / "reports" / "breakdown_script.png"))
