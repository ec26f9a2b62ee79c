#!/usr/bin/env bash
# SteerLM on the synthetic sort task (docs/algorithms/dpo.md, "SteerLM"), on the `local` profile:
#   HelpSteer2-format rows (attributes computed from the task) -> regression reward model
#   -> its predicted attributes label the SFT rows (steerlm-label) -> attribute-conditioned SFT
#   -> greedy held-out accuracy conditioned on correctness 4 and on correctness 0.
# The settings are those of the opt-in test (tests/unit/algorithms/test_steerlm.py,
# SLURM_ALIGN_STEERLM=1). Usage (repo root): bash examples/steerlm_tiny.sh [RUNS_DIR] [PROFILE]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-runs/steerlm}"
profile="${2:-local}"
sa=.venv/bin/slurm-align
mkdir -p "$runs"

# 1. HelpSteer2-format data: per prompt of the task's preference pairs the sorted answer
#    (correctness 4) and the digits as given (0), verbosity from the answer's length
[[ -e "$runs/data/helpsteer_val.jsonl" ]] || .venv/bin/python -m slurm_align.data.helpsteer "$runs/data"
# 2. the regression reward model: one head per attribute (correctness, verbosity), MSE
[[ -e "$runs/rm/checkpoints/rm" ]] || "$sa" train rm examples/steerlm_rm_tiny.yaml --profile "$profile" \
    --run-dir "$runs/rm" --follow data.train_path="$runs/data/helpsteer_train.jsonl" \
    data.val_path="$runs/data/helpsteer_val.jsonl"
# 3. label the SFT rows with the reward model's predicted attributes: each input becomes
#    `7391=<attributes>correctness:4,verbosity:2</attributes>`
[[ -e "$runs/labelled.jsonl" ]] || "$sa" steerlm-label "$runs/rm/checkpoints/rm" \
    --data "$runs/data/helpsteer_train.jsonl" --out "$runs/labelled.jsonl"
# 4. attribute-conditioned SFT on the labelled rows (lr 3e-3 decayed to 1e-4, cosine)
[[ -e "$runs/sft/checkpoints/sft" ]] || "$sa" train sft examples/sft_tiny.yaml --profile "$profile" \
    --run-dir "$runs/sft" --follow data.train_path="$runs/labelled.jsonl" data.val_path=null \
    model.max_seq_len=80 seed=7 trainer.num_steps=800 trainer.global_batch_size=32 \
    trainer.micro_batch_size=16 trainer.lr=3.0e-3 trainer.save_interval=0 training.lr_decay_style=cosine \
    training.lr_decay_steps=800 training.min_lr=1.0e-4
# 5. held-out greedy answers (2,000 prompts never trained on) conditioned on correctness 4 and 0,
#    verbosity 2 (a 4-5 digit answer's) both times
for c in 4 0; do
  [[ -e "$runs/eval-correctness$c/eval" ]] || "$sa" eval "$runs/sft/checkpoints/sft" --config examples/grpo_tiny.yaml \
      --data examples/synthetic/prompts_val.jsonl --attributes "correctness=$c,verbosity=2" --profile "$profile" \
      --run-dir "$runs/eval-correctness$c" --follow model.max_seq_len=80 >/dev/null
done
for c in 4 0; do
  .venv/bin/python -c "import json, pathlib, sys; m = json.loads(sorted(pathlib.Path(sys.argv[1]).glob(
      'metrics_step_*.json'))[-1].read_text()); print(f'correctness {sys.argv[2]}: held-out exact accuracy',
      m['val/score'])" "$runs/eval-correctness$c/eval" "$c"
done
