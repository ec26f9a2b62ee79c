#!/bin/bash
# Rendered by slurm-align 0.1.0 for run /scratch/runs/golden. Re-render instead of editing.
#SBATCH --job-name=sa-ppo-golden
#SBATCH --output=/scratch/runs/golden/logs/job-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR2@300
#SBATCH --no-requeue
# job_shape single: one job for actor + critic (nodes of its own each)
#SBATCH --partition=debug
#SBATCH --time=00:10:00
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1

# Exit codes: 0 completed (or stopped and requeued), 1 a component failed,
# 75 stopped at a checkpoint and not requeued (`slurm-align status` shows STOPPED).
set -eo pipefail
set -u   # only now: Lmod's `module` and many set-up scripts read unset variables
export OMP_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export SLURM_ALIGN_RUN_DIR=/scratch/runs/golden
export SLURM_ALIGN_PREEMPT_GRACE_S=0   # profile preempt_grace_s: TERM to KILL
export SLURM_ALIGN_COMPONENTS=actor,critic

cd /scratch/runs/golden

# A requeued job (by this script or by Slurm itself: preemption, a node failure) runs this script
# again: clear what the previous start left behind, the serving components' addresses first
# (a host:port may belong to another process by now; clients accept only an address of this start).
export SLURM_ALIGN_START="${SLURM_JOB_ID:-local-$$}:${SLURM_RESTART_COUNT:-0}"
rm -f "$SLURM_ALIGN_RUN_DIR/critic_address.json" "$SLURM_ALIGN_RUN_DIR"/logs/*/exit_code \
  "$SLURM_ALIGN_RUN_DIR/logs/first_failure" "$SLURM_ALIGN_RUN_DIR/stop_requested" \
  "$SLURM_ALIGN_RUN_DIR/stopped_step" "$SLURM_ALIGN_RUN_DIR/stopped_by"
# shellcheck disable=SC2329  # called from the traps below
event() { echo "{\"event\": \"$1\", \"time\": $(date +%s.%N)${2:+, $2}}" >>"$SLURM_ALIGN_RUN_DIR/preemption.jsonl"; }
# Requeues are counted by Slurm (SLURM_RESTART_COUNT: every requeue, Slurm's own included), and
# max_requeues holds for all of them: past it this start ends at once as STOPPED.
restarts="${SLURM_RESTART_COUNT:-0}"
echo "$restarts" >"$SLURM_ALIGN_RUN_DIR/.requeue_count.tmp"
mv "$SLURM_ALIGN_RUN_DIR/.requeue_count.tmp" "$SLURM_ALIGN_RUN_DIR/requeue_count"
if (( restarts > 0 )); then
  event started "\"restart_count\": $restarts"
fi
if (( restarts > 0 )); then
  echo "slurm-align: this job was requeued $restarts times, more than max_requeues=0 (requeue false); it ends here (resume: slurm-align submit --resume $SLURM_ALIGN_RUN_DIR)" >&2
  IFS=, read -r -a all_components <<<"$SLURM_ALIGN_COMPONENTS"
  for name in "${all_components[@]}"; do
    mkdir -p "$SLURM_ALIGN_RUN_DIR/logs/$name"
    echo 75 >"$SLURM_ALIGN_RUN_DIR/logs/$name/exit_code"
  done
  exit 75
fi

pids=()
names=()
# Preemption and the time limit: Slurm signals this script (USR2 from --signal=B:USR2@grace,
# TERM on cancel). Record the request in a file: the actor's ranks check it at each step
# boundary, agree on a stop point, save every role (the critic through the actor) and write
# stopped_step. The signal itself is not passed on: Slurm delivers it to whole process groups,
# where helper processes (checkpoint writers, tritonserver) would die of it.
stop_requested=0
terminating=0
# shellcheck disable=SC2329  # called by the traps below
request_stop() {
  if [[ "$1" == TERM ]]; then
    terminating=1   # Slurm is ending the job (cancel, time limit): its state says how, not exit codes
  fi
  if [[ "$stop_requested" -eq 0 ]]; then
    stop_requested=1
    echo "slurm-align: $1 received: stopping at the next step boundary" >&2
    event stop_requested "\"signal\": \"$1\""
    date +%s.%N >"$SLURM_ALIGN_RUN_DIR/stop_requested"
  fi
}
trap 'request_stop USR2' USR2
trap 'request_stop TERM' TERM
# job_shape single: one allocation; each component gets nodes of its own, named in variables
# that slurm_align.slurm.hetenv reads like a hetjob's (not SLURM_*_HET_GROUP_*: srun would
# then take the job for a hetjob and refuse to start).
mapfile -t all_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
SLURM_ALIGN_NODELIST_0="$(IFS=,; echo "${all_nodes[*]:0:2}")"
export SLURM_ALIGN_NODELIST_0
export SLURM_ALIGN_NTASKS_0=2
SLURM_ALIGN_NODELIST_1="$(IFS=,; echo "${all_nodes[*]:2:1}")"
export SLURM_ALIGN_NODELIST_1
export SLURM_ALIGN_NTASKS_1=1

# Pre-flight: every node of every component sees the run directory and can run slurm-align.
mkdir -p /scratch/runs/golden/logs/actor
# shellcheck disable=SC2016  # $1, $2 and the node name expand on the node, not here
if ! SRUN_CPUS_PER_TASK=1 srun --nodelist="$SLURM_ALIGN_NODELIST_0" --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=1 --kill-on-bad-exit=1 --wait=0 --mpi=none \
  bash -c 'node="${SLURMD_NODENAME:-$(hostname)}"; if [[ ! -d "$2" ]]; then echo "slurm-align pre-flight failed on node $node: run directory $2 is not visible there"; exit 3; fi; if ! out="$("$1" -c "import slurm_align" 2>&1)"; then echo "slurm-align pre-flight failed on node $node: $1 cannot import slurm_align: $(echo "$out" | tail -n 1)"; exit 4; fi' \
  slurm-align-preflight /opt/venv/bin/python /scratch/runs/golden >>/scratch/runs/golden/logs/actor/preflight.log 2>&1; then
  reason="$(grep -m 1 "pre-flight failed" /scratch/runs/golden/logs/actor/preflight.log || tail -n 1 /scratch/runs/golden/logs/actor/preflight.log)"
  echo "slurm-align: component actor: $reason" >&2
  echo actor >"$SLURM_ALIGN_RUN_DIR/logs/first_failure"
  echo 1 >/scratch/runs/golden/logs/actor/exit_code
  exit 1
fi
mkdir -p /scratch/runs/golden/logs/critic
# shellcheck disable=SC2016  # $1, $2 and the node name expand on the node, not here
if ! SRUN_CPUS_PER_TASK=1 srun --nodelist="$SLURM_ALIGN_NODELIST_1" --nodes=1 --ntasks=1 --ntasks-per-node=1 --cpus-per-task=1 --kill-on-bad-exit=1 --wait=0 --mpi=none \
  bash -c 'node="${SLURMD_NODENAME:-$(hostname)}"; if [[ ! -d "$2" ]]; then echo "slurm-align pre-flight failed on node $node: run directory $2 is not visible there"; exit 3; fi; if ! out="$("$1" -c "import slurm_align" 2>&1)"; then echo "slurm-align pre-flight failed on node $node: $1 cannot import slurm_align: $(echo "$out" | tail -n 1)"; exit 4; fi' \
  slurm-align-preflight /opt/venv/bin/python /scratch/runs/golden >>/scratch/runs/golden/logs/critic/preflight.log 2>&1; then
  reason="$(grep -m 1 "pre-flight failed" /scratch/runs/golden/logs/critic/preflight.log || tail -n 1 /scratch/runs/golden/logs/critic/preflight.log)"
  echo "slurm-align: component critic: $reason" >&2
  echo critic >"$SLURM_ALIGN_RUN_DIR/logs/first_failure"
  echo 1 >/scratch/runs/golden/logs/critic/exit_code
  exit 1
fi

# --- component actor: 2 rank(s), logs in /scratch/runs/golden/logs/actor/ ---
mkdir -p /scratch/runs/golden/logs/actor
# shellcheck disable=SC2016  # $rank and $@ expand on each rank, not here
SLURM_ALIGN_COMPONENT=actor SLURM_ALIGN_LOG_DIR=/scratch/runs/golden/logs/actor \
  SRUN_CPUS_PER_TASK=1 \
  srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist="$SLURM_ALIGN_NODELIST_0" --mpi=pmix --kill-on-bad-exit=1 --wait=0 --cpus-per-task=1 --cpu-bind=cores \
  bash -c 'rank="${SLURM_PROCID:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-0}}}"; exec "$@" >>"$SLURM_ALIGN_LOG_DIR/rank${rank}.log" 2>&1' \
  slurm-align-rank /opt/venv/bin/python -u -m slurm_align.launchers.report --run-dir /scratch/runs/golden >>/scratch/runs/golden/logs/actor/launcher.log 2>&1 &
pids+=("$!")
names+=(actor)

# --- component critic: 1 rank(s), logs in /scratch/runs/golden/logs/critic/ ---
mkdir -p /scratch/runs/golden/logs/critic
# shellcheck disable=SC2016  # $rank and $@ expand on each rank, not here
SLURM_ALIGN_COMPONENT=critic SLURM_ALIGN_LOG_DIR=/scratch/runs/golden/logs/critic \
  SRUN_CPUS_PER_TASK=1 \
  srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist="$SLURM_ALIGN_NODELIST_1" --mpi=pmix --kill-on-bad-exit=1 --wait=0 --cpus-per-task=1 --cpu-bind=cores \
  bash -c 'rank="${SLURM_PROCID:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-0}}}"; exec "$@" >>"$SLURM_ALIGN_LOG_DIR/rank${rank}.log" 2>&1' \
  slurm-align-rank /opt/venv/bin/python -u -m slurm_align.launchers.report --run-dir /scratch/runs/golden >>/scratch/runs/golden/logs/critic/launcher.log 2>&1 &
pids+=("$!")
names+=(critic)

# Reap components as they end; keep each exit code next to its logs. The job fails if any
# component fails, and the first failure stops the others (a dead critic would otherwise
# leave the actor waiting until its timeout). `wait -n` reaps exactly one child (or returns
# early for a trapped signal); `-p` names it where bash has it (5.1+), else the one that no
# longer exists is the one that ended (zombies still answer kill -0).
failed=0
stopping=0
declare -A ended=()
n_ended=0
while (( n_ended < 2 )); do
  code=0
  done_pid=""
  if (( BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 501 )); then
    wait -n -p done_pid || code=$?
    done_pid="${done_pid:-}"   # unset when a trapped signal ended the wait
  else
    wait -n || code=$?
  fi
  for i in "${!pids[@]}"; do
    if [[ -z "${ended[$i]:-}" ]] && { [[ "${pids[$i]}" == "$done_pid" ]] || { [[ -z "$done_pid" ]] && ! kill -0 "${pids[$i]}" 2>/dev/null; }; }; then
      ended[$i]=1
      n_ended=$((n_ended + 1))
      if [[ "$terminating" -eq 1 || "$stopping" -eq 1 ]]; then
        break   # stopping: the stop is recorded; how an ended component went does not change it
      fi
      echo "$code" >"$SLURM_ALIGN_RUN_DIR/logs/${names[$i]}/exit_code"
      if [[ "${names[$i]}" == actor && "$code" -eq 0 && -e "$SLURM_ALIGN_RUN_DIR/stopped_step" ]]; then
        # The actor stopped for preemption after every role saved: the others need not wind
        # down (the critic's server takes seconds to stop); end them and requeue sooner. The
        # stop is recorded first: a component ended by this kill exits non-zero (read as
        # FAILED), and the time limit's kill may end the job before the others are reaped
        # (CI: a job that stopped and saved read FAILED).
        stopping=1
        for name in "${names[@]}"; do
          echo 75 >"$SLURM_ALIGN_RUN_DIR/logs/$name/exit_code"   # read as STOPPED, not COMPLETED
        done
        echo "slurm-align: the actor stopped at step $(cat "$SLURM_ALIGN_RUN_DIR/stopped_step") and every role saved; ending the other components" >&2
        kill "${pids[@]}" 2>/dev/null || true
      elif [[ "$code" -ne 0 && "$failed" -eq 0 && "$stopping" -eq 0 ]]; then
        echo "slurm-align: component ${names[$i]} failed with exit code $code; stopping the others" >&2
        echo "${names[$i]}" >"$SLURM_ALIGN_RUN_DIR/logs/first_failure"
        failed=1
        kill "${pids[@]}" 2>/dev/null || true
      fi
      break
    fi
  done
done
if [[ "$failed" -ne 0 ]]; then
  exit 1
fi
# The actor stopped at a checkpoint for preemption (slurm_align.slurm.preemption): its ranks
# exit 0 (srun would kill the slower ones at a non-zero exit) and rank 0 wrote stopped_step.
if [[ -e "$SLURM_ALIGN_RUN_DIR/stopped_step" ]]; then
  for name in "${names[@]}"; do
    echo 75 >"$SLURM_ALIGN_RUN_DIR/logs/$name/exit_code"   # read as STOPPED, not COMPLETED
  done
  step="$(cat "$SLURM_ALIGN_RUN_DIR/stopped_step")"
  echo "slurm-align: stopped for preemption at step $step (resume: slurm-align submit --resume $SLURM_ALIGN_RUN_DIR)" >&2
  exit 75
fi
exit 0
