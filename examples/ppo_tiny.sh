#!/usr/bin/env bash
# The whole tiny RLHF pipeline on the `local` profile (no Slurm): SFT -> reward model -> PPO.
# Usage (from the repo root, after bash .ci/setup.sh): bash examples/ppo_tiny.sh [RUNS_DIR] [PROFILE]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-runs/tiny}"
profile="${2:-local}"
sa=.venv/bin/slurm-align
mkdir -p "$runs"

[[ -e "$runs/sft/checkpoints/sft" ]] || "$sa" train sft examples/sft_tiny.yaml --profile "$profile" --run-dir "$runs/sft" --follow
[[ -e "$runs/rm/checkpoints/rm" ]] || "$sa" train rm examples/rm_tiny.yaml --profile "$profile" --run-dir "$runs/rm" --follow
"$sa" submit examples/ppo_tiny.yaml --profile "$profile" --run-dir "$runs/ppo" --follow \
    model.init_checkpoint="$runs/sft/checkpoints/sft" critic_model.init_checkpoint="$runs/rm/checkpoints/rm"
"$sa" analyze breakdown "$runs/ppo"
