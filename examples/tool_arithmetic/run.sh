#!/usr/bin/env bash
# Tool use on the `local` profile: SFT on calculator calls, then GRPO with the calculator and, as
# the control, the same GRPO without the tool. Ends with one line:
#   held-out exact accuracy: X% before GRPO, Y% after (tool calls per answer: Z)
# and the control's line. Usage (from the repo root): bash examples/tool_arithmetic/run.sh [RUNS_DIR] [PROFILE]
set -euo pipefail
cd "$(dirname "$0")/../.."
runs="${1:-runs/tool_arithmetic}"
profile="${2:-local}"
sa=.venv/bin/slurm-align
ex=examples/tool_arithmetic
mkdir -p "$runs"

[[ -e $ex/sft_train.jsonl ]] || .venv/bin/python $ex/generate.py
[[ -e "$runs/sft/checkpoints/sft" ]] || "$sa" train sft $ex/sft.yaml --profile "$profile" --run-dir "$runs/sft" --follow
sft="model.init_checkpoint=$runs/sft/checkpoints/sft"
"$sa" submit $ex/grpo.yaml --profile "$profile" --run-dir "$runs/grpo_tool" --follow "$sft"
"$sa" submit $ex/grpo.yaml --profile "$profile" --run-dir "$runs/grpo_no_tool" --follow "$sft" \
    environment.environment=rule 'environment.tools=[]' environment.max_turns=1 \
    environment.max_turn_tokens=null environment.max_total_tokens=null
.venv/bin/python - "$runs" <<'PY'
import json, sys
from pathlib import Path

def val(run):
    rows = [json.loads(x) for x in (Path(sys.argv[1]) / run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "val/score" in r]
    return rows[0], rows[-1]

(b, a), (cb, ca) = val("grpo_tool"), val("grpo_no_tool")
print(f"no-tool control: held-out exact accuracy {100 * cb['val/score']:.1f}% before GRPO, {100 * ca['val/score']:.1f}% after")
print(f"held-out exact accuracy: {100 * b['val/score']:.1f}% before GRPO, {100 * a['val/score']:.1f}% after "
      f"(tool calls per answer: {a.get('val/tool_calls', 0.0):.2f})")
PY
