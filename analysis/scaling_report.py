"""Scaling table of a sweep directory as JSON lines (same numbers as `slurm-align analyze scaling`).

    python analysis/scaling_report.py SWEEP_DIR
"""

import json
import sys

from slurm_align.analysis.plots import plot_scaling
from slurm_align.analysis.scaling import compute_scaling

if __name__ == "__main__":
    report = compute_scaling(sys.argv[1], allow_incomplete=True)
    for point in report.to_dict()["points"]:
        print(json.dumps(point))
    print("chart:", plot_scaling(report, report.sweep_dir / "scaling_script.png"))
