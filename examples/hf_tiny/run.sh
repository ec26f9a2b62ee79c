#!/usr/bin/env bash
# The tiny Hugging Face pipeline on the `local` profile: make the model, SFT -> RM -> PPO, then
# export the PPO policy as a Hugging Face folder that transformers loads.
# Usage (from the repo root): bash examples/hf_tiny/run.sh [RUNS_DIR] [PROFILE]
set -euo pipefail
cd "$(dirname "$0")/../.."
runs="${1:-runs/hf_tiny}"
profile="${2:-local}"
sa=.venv/bin/slurm-align
mkdir -p "$runs"

[[ -e examples/hf_tiny/model/config.json ]] || .venv/bin/python examples/hf_tiny/make_model.py
[[ -e "$runs/sft/checkpoints/sft" ]] || "$sa" train sft examples/hf_tiny/sft.yaml --profile "$profile" --run-dir "$runs/sft" --follow
[[ -e "$runs/rm/checkpoints/rm" ]] || "$sa" train rm examples/hf_tiny/rm.yaml --profile "$profile" --run-dir "$runs/rm" --follow
"$sa" submit examples/hf_tiny/ppo.yaml --profile "$profile" --run-dir "$runs/ppo" --follow \
    model.init_checkpoint="$runs/sft/checkpoints/sft" critic_model.init_checkpoint="$runs/rm/checkpoints/rm"
"$sa" export hf "$runs/ppo/checkpoints/actor" "$runs/policy_hf"
