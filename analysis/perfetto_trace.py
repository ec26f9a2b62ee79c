"""Chrome/Perfetto trace JSON of a run (same as `slurm-align analyze trace`).

    python analysis/perfetto_trace.py RUN_DIR trace.json    # then open https://ui.perfetto.dev
"""

import sys
from pathlib import Path

from slurm_align.analysis.runs import load_run
from slurm_align.analysis.trace_export import write_chrome_trace

if __name__ == "__main__":
    run = load_run(sys.argv[1], allow_incomplete=True)
    print(write_chrome_trace(run.spans, Path(sys.argv[2]), run.name), "spans written")
