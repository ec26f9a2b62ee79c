#!/usr/bin/env bash
# Constitutional AI on the synthetic sort task (docs/cai.md), NeMo-Aligner's pipeline as commands,
# on the `local` profile:
#   weak SFT policy -> red-team prompts -> responses -> critique + revision by the judge (revise)
#   -> SFT on the revisions -> sampled pairs -> AI preference labels (label) -> DPO
# and the same pipeline without feedback (--random-labels: random revisions and labels), the control.
# The judge is a small model trained here (examples/judge_tiny.yaml) on the rule's verdicts of the
# right answer against the SFT policy's own wrong samples on prompts of its own (none of the red-team
# or held-out prompts) and of the rule's corruptions, so the feedback is a model's, not the rule's.
# Usage (repo root): bash examples/cai_tiny.sh [RUNS_DIR] [PROFILE]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-runs/cai}"
profile="${2:-local}"
sa=.venv/bin/slurm-align
synth=examples/synthetic
mkdir -p "$runs"

# 0. the start: a weak SFT policy (50 steps, as the tests' session policy), and the judge
[[ -e "$runs/sft/checkpoints/sft" ]] || "$sa" train sft examples/sft_tiny.yaml --profile "$profile" \
    --run-dir "$runs/sft" --follow trainer.num_steps=50 trainer.save_interval=0
#    the judge's data: the policy's samples on the judge's own prompts, each pair labelled by the rule
[[ -e "$runs/judge-data/judge_prompts.jsonl" ]] || .venv/bin/python -m slurm_align.judge.sort_pairs "$runs/judge-data" \
    --prompts 2000 --exclude "$synth"/*.jsonl
[[ -e "$runs/judge-samples/generate" ]] || "$sa" generate "$runs/sft/checkpoints/sft" --config examples/grpo_tiny.yaml \
    --data "$runs/judge-data/judge_prompts.jsonl" --samples 8 --temperature 1.0 --profile "$profile" \
    --run-dir "$runs/judge-samples" --follow
#    beside the rule's near misses (one digit off) and the judge's auxiliary task, the right answer
#    written out (sort_pairs.sort_demo_rows), none on the task's prompts
[[ -e "$runs/judge-data/judge_train.jsonl" ]] || .venv/bin/python -m slurm_align.judge.sort_pairs "$runs/judge-data" \
    --samples "$runs/judge-samples/generate" --rule-pairs 2000 --near-misses 20000 --demos 20000 --exclude "$synth"/*.jsonl
[[ -e "$runs/judge-model/checkpoints/sft" ]] || "$sa" train sft examples/judge_tiny.yaml --profile "$profile" \
    --run-dir "$runs/judge-model" --follow data.train_path="$runs/judge-data/judge_train.jsonl" \
    data.val_path="$runs/judge-data/judge_val.jsonl" trainer.num_steps=8000
judge=(judge.model.init_checkpoint="$runs/judge-model/checkpoints/sft")

# 1. red-team prompts (the task's training prompts) -> 8 responses each from the SFT policy (T 0.7)
[[ -e "$runs/responses/generate" ]] || "$sa" generate "$runs/sft/checkpoints/sft" --config examples/grpo_tiny.yaml \
    --data "$synth/prompts.jsonl" --samples 8 --temperature 0.7 --profile "$profile" --run-dir "$runs/responses" --follow

for arm in judge control; do
  flag=(); [[ $arm == control ]] && flag=(--random-labels)
  out="$runs/$arm"; mkdir -p "$out"
  # 2-3. critique against the principle + revision (the judge's pick of the prompt's responses)
  "$sa" revise "$runs/responses/generate" --config examples/cai_tiny.yaml --out "$out/revisions.jsonl" "${flag[@]}" "${judge[@]}"
  # 4. SFT on the revisions, from the SFT policy
  [[ -e "$out/sft_rev/checkpoints/sft" ]] || "$sa" train sft examples/sft_tiny.yaml --profile "$profile" \
      --run-dir "$out/sft_rev" --follow model.init_checkpoint="$runs/sft/checkpoints/sft" \
      data.train_path="$out/revisions.jsonl" data.val_path="$out/revisions.jsonl" \
      trainer.num_steps=40 trainer.lr=1.0e-3 trainer.save_interval=0
  # 5. sampled pairs from the revised policy
  [[ -e "$out/pairs/generate" ]] || "$sa" generate "$out/sft_rev/checkpoints/sft" --config examples/grpo_tiny.yaml \
      --data "$synth/prompts.jsonl" --samples 2 --temperature 0.7 --profile "$profile" --run-dir "$out/pairs" --follow
  # 6. AI preference labels from the judge (control: a coin)
  "$sa" label "$out/pairs/generate" --config examples/cai_tiny.yaml --out "$out/labels.jsonl" "${flag[@]}" "${judge[@]}"
  # 7. DPO on them with RPO's SFT term on the chosen answer, lr 1e-4 (the preference tests' settings:
  #    the preference term alone lowers a tiny policy's accuracy here, tests/integration/test_preference_learning.py)
  [[ -e "$out/dpo/checkpoints/dpo" ]] || "$sa" train dpo examples/dpo_tiny.yaml --profile "$profile" \
      --run-dir "$out/dpo" --follow model.init_checkpoint="$out/sft_rev/checkpoints/sft" \
      data.train_path="$out/labels.jsonl" data.val_path="$out/labels.jsonl" \
      trainer.num_steps=30 trainer.lr=1.0e-4 loss.options.sft_weight=1.0 trainer.save_interval=0
done

# held-out exact accuracy (greedy, 2,000 prompts never trained on) of each policy
for m in sft:"$runs/sft/checkpoints/sft" judge_sft:"$runs/judge/sft_rev/checkpoints/sft" \
         judge_dpo:"$runs/judge/dpo/checkpoints/dpo" control_sft:"$runs/control/sft_rev/checkpoints/sft" \
         control_dpo:"$runs/control/dpo/checkpoints/dpo"; do
  name=${m%%:*}; ckpt=${m#*:}
  [[ -e "$runs/eval-$name/eval" ]] || "$sa" eval "$ckpt" --config examples/grpo_tiny.yaml \
      --data "$synth/prompts_val.jsonl" --profile "$profile" --run-dir "$runs/eval-$name" --follow >/dev/null
done
.venv/bin/python -m slurm_align.judge.cai_report "$runs"
