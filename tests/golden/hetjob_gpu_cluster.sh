#!/bin/bash
# Rendered by slurm-align 0.1.0 for run /scratch/runs/golden. Re-render instead of editing.
#SBATCH --job-name=sa-ppo-golden
#SBATCH --output=/scratch/runs/golden/logs/job-%j.out
# component 0: actor
#SBATCH --partition=gpu
#SBATCH --account=my-project
#SBATCH --qos=normal
#SBATCH --constraint=h100
#SBATCH --time=04:00:00
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --gpus-per-node=8
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH hetjob
# component 1: critic
#SBATCH --partition=gpu
#SBATCH --account=my-project
#SBATCH --qos=normal
#SBATCH --constraint=h100
#SBATCH --time=04:00:00
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --gpus-per-node=8
#SBATCH --mem=0
#SBATCH --exclusive

set -euo pipefail
export NCCL_IB_SL=1
export NCCL_DEBUG=WARN
export OMP_NUM_THREADS=8
# secret WANDB_API_KEY: inherited from the submitting shell by name, never written here
if [[ -z "${WANDB_API_KEY+x}" ]]; then echo "slurm-align: secret variable WANDB_API_KEY is not set in the job environment" >&2; exit 1; fi
export WANDB_API_KEY
export SLURM_ALIGN_RUN_DIR=/scratch/runs/golden
export SLURM_ALIGN_COMPONENTS=actor,critic

cd $REPO

pids=()
names=()
# --- component actor: 32 rank(s), logs in /scratch/runs/golden/logs/actor/ ---
mkdir -p /scratch/runs/golden/logs/actor
# shellcheck disable=SC2016  # $rank and $@ expand on each rank, not here
SLURM_ALIGN_COMPONENT=actor SLURM_ALIGN_LOG_DIR=/scratch/runs/golden/logs/actor \
  srun --het-group=0 --mpi=pmix --kill-on-bad-exit=1 --container-image=nvcr.io/nvidia/nemo:25.04 --container-mounts=/lustre/datasets:/data:ro,/lustre/users/me:/work \
  bash -c 'rank="${SLURM_PROCID:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-0}}}"; exec "$@" >"$SLURM_ALIGN_LOG_DIR/rank${rank}.log" 2>&1' \
  slurm-align-rank /opt/venv/bin/python -u $REPO/launchers/report.py --run-dir /scratch/runs/golden &
pids+=("$!")
names+=(actor)

# --- component critic: 16 rank(s), logs in /scratch/runs/golden/logs/critic/ ---
mkdir -p /scratch/runs/golden/logs/critic
# shellcheck disable=SC2016  # $rank and $@ expand on each rank, not here
SLURM_ALIGN_COMPONENT=critic SLURM_ALIGN_LOG_DIR=/scratch/runs/golden/logs/critic \
  srun --het-group=1 --mpi=pmix --kill-on-bad-exit=1 --container-image=nvcr.io/nvidia/nemo:25.04 --container-mounts=/lustre/datasets:/data:ro,/lustre/users/me:/work \
  bash -c 'rank="${SLURM_PROCID:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-0}}}"; exec "$@" >"$SLURM_ALIGN_LOG_DIR/rank${rank}.log" 2>&1' \
  slurm-align-rank /opt/venv/bin/python -u $REPO/launchers/report.py --run-dir /scratch/runs/golden &
pids+=("$!")
names+=(critic)

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
