#!/bin/bash
# Rendered by slurm-align 0.1.0 for run /scratch/runs/golden. Re-render instead of editing.
#SBATCH --job-name=sa-sft-golden
#SBATCH --output=/scratch/runs/golden/logs/job-%j.out
#SBATCH --partition=debug
#SBATCH --account=proj-1
#SBATCH --time=00:10:00
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1

set -euo pipefail
export OMP_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export SLURM_ALIGN_RUN_DIR=/scratch/runs/golden
export SLURM_ALIGN_COMPONENTS=actor

cd $REPO

pids=()
names=()
# --- component actor: 2 rank(s), logs in /scratch/runs/golden/logs/actor/ ---
mkdir -p /scratch/runs/golden/logs/actor
# shellcheck disable=SC2016  # $rank and $@ expand on each rank, not here
SLURM_ALIGN_COMPONENT=actor SLURM_ALIGN_LOG_DIR=/scratch/runs/golden/logs/actor \
  srun --mpi=pmix --kill-on-bad-exit=1 \
  bash -c 'rank="${SLURM_PROCID:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-0}}}"; exec "$@" >"$SLURM_ALIGN_LOG_DIR/rank${rank}.log" 2>&1' \
  slurm-align-rank /opt/venv/bin/python -u $REPO/launchers/report.py --run-dir /scratch/runs/golden &
pids+=("$!")
names+=(actor)

# Reap components as they end; keep each exit code next to its logs. The job fails if any
# component fails, and the first failure stops the others (a dead critic would otherwise
# leave the actor waiting until its timeout). `wait -n` reaps exactly one child; the one
# that no longer exists is the one that ended (zombies still answer kill -0).
failed=0
declare -A ended=()
for _ in "${pids[@]}"; do
  code=0
  wait -n || code=$?
  for i in "${!pids[@]}"; do
    if [[ -z "${ended[$i]:-}" ]] && ! kill -0 "${pids[$i]}" 2>/dev/null; then
      ended[$i]=1
      echo "$code" >"$SLURM_ALIGN_RUN_DIR/logs/${names[$i]}/exit_code"
      if [[ "$code" -ne 0 && "$failed" -eq 0 ]]; then
        echo "slurm-align: component ${names[$i]} failed with exit code $code; stopping the others" >&2
        failed=1
        kill "${pids[@]}" 2>/dev/null || true
      fi
      break
    fi
  done
done
exit "$failed"
