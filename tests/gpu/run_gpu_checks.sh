#!/usr/bin/env bash
# Every GPU check, on a GPU machine that may reach no package registry (this project's own GPU
# machine: shared/STACK.md, "turn 3"), or in an NVIDIA TensorRT-LLM container.
#
#     bash tests/gpu/run_gpu_checks.sh [--wheelhouse DIR] [--python PY]     (log: gpu_checks.log)
#
# 1. No GPU (no /dev/nvidia*, CUDA_VISIBLE_DEVICES empty, or torch sees none): prints "no GPU",
#    the figures line with NA, exits 0. Nothing is installed and nothing else runs.
# 2. --wheelhouse DIR (made where the registry is reachable: tests/gpu/make_wheelhouse.sh): its
#    wheels are installed with `pip install --no-index --find-links DIR --no-deps --target
#    .gpu-deps`, a folder of this checkout put on PYTHONPATH: the machine's environment is never
#    changed, its torch never replaced (torch-stack wheels in DIR, and wheels of anything the
#    machine already has, are left out: tests/gpu/wheel_select.py; torch's version is checked
#    before and after). Without --wheelhouse nothing is installed.
# 3. What cannot be there (TensorRT-LLM, Transformer Engine, PyTriton: too large to bring) is
#    reported as skipped with the reason, and its checks skip.
# 4. The API fixture against the installed GPU packages (tests/gpu/extract_api.py --check), the
#    single-process GPU checks (tests/gpu/gpu_checks.py: NCCL on one GPU, megatron-core on CUDA
#    with the local spec and the TE spec when present, the torch KV-cache engine in bf16 against
#    transformers on the same GPU, the engine refit, a GRPO step), every `gpu`-marked test (those
#    that start ranks with mpirun deselected when there is no mpirun), and with TensorRT-LLM
#    present its benchmark. No check needs mpirun.
# Each step gets what is left of a budget (GPU_CHECK_BUDGET_S, default 590 s). Last line:
#     torch_gpu_tok_s=... refit_s=... grpo_step_s=... trtllm_tok_s=...      (NA: not measured)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
REPO=$(pwd)
WHEELHOUSE=""
PY=${PYTHON:-python3}
while (($#)); do
    case $1 in
        --wheelhouse) WHEELHOUSE=${2:?--wheelhouse needs a folder}; shift 2 ;;
        --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
        -h | --help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "run_gpu_checks.sh: unknown argument $1 (allowed: --wheelhouse DIR, --python PY)" >&2; exit 2 ;;
    esac
done
NA_LINE="torch_gpu_tok_s=NA refit_s=NA grpo_step_s=NA trtllm_tok_s=NA"

# --- 1. a GPU at all? (before anything else: seconds, nothing installed) -------------------
no_gpu() {
    echo "no GPU: $* (nothing installed, nothing run)"
    echo "$NA_LINE"
    exit 0
}
if [[ -v CUDA_VISIBLE_DEVICES && ( -z $CUDA_VISIBLE_DEVICES || $CUDA_VISIBLE_DEVICES == -1 ) ]]; then
    no_gpu "CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' hides every GPU"
fi
compgen -G '/dev/nvidia[0-9]*' >/dev/null || command -v nvidia-smi >/dev/null ||
    no_gpu "no /dev/nvidia* device and no nvidia-smi on this machine"
command -v "$PY" >/dev/null || no_gpu "no Python interpreter '$PY' (give --python PY)"
gpus=$(timeout 60 "$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' \
    2>/dev/null) || gpus=0
((gpus > 0)) || no_gpu "$PY's torch sees no CUDA device (or has no torch)"

BUDGET_S=${GPU_CHECK_BUDGET_S:-590}
LOG=${GPU_CHECK_LOG:-gpu_checks.log}
START=$SECONDS
: >"$LOG"
say() { echo "[gpu-checks $((SECONDS - START))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET_S - (SECONDS - START))); }
# run LIMIT_S CMD...: the command under `timeout` (at most what is left), output into the log.
run() {
    local limit=$1 cap
    shift
    cap=$(left)
    ((limit > cap)) && limit=$cap
    if ((limit < 10)); then
        say "skipped (budget spent): $*"
        return 124
    fi
    timeout "$limit" "$@" >>"$LOG" 2>&1
}
failures=()
command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 | tee -a "$LOG"
torch_before=$("$PY" -c 'import torch; print(torch.__version__)')
say "python $("$PY" -c 'import sys; print(sys.version.split()[0])') ($PY), torch $torch_before, $gpus GPU(s)"

# --- 2. the wheelhouse, beside the machine's environment ------------------------------------
DEPS=$REPO/.gpu-deps
if [[ -n $WHEELHOUSE ]]; then
    [[ -d $WHEELHOUSE ]] || { say "--wheelhouse $WHEELHOUSE: not a folder"; echo "$NA_LINE"; exit 2; }
    # the machine's torch stack and whatever it already has are left out (tests/gpu/wheel_select.py)
    mapfile -t wheels < <("$PY" tests/gpu/wheel_select.py "$WHEELHOUSE" 2> >(tee -a "$LOG" >&2))
    say "pip install --no-index --find-links $WHEELHOUSE --no-deps --target .gpu-deps (${#wheels[@]} wheels)"
    rm -rf "$DEPS"
    if ((${#wheels[@]})); then
        run 180 "$PY" -m pip install --disable-pip-version-check -q --no-index --find-links "$WHEELHOUSE" \
            --no-deps --target "$DEPS" "${wheels[@]}" || failures+=("wheelhouse install")
    fi
fi
pp=$REPO
[[ -d $DEPS ]] && pp="$pp:$DEPS"
export PYTHONPATH="$pp${PYTHONPATH:+:$PYTHONPATH}"
torch_after=$("$PY" -c 'import torch; print(torch.__version__)')
[[ $torch_after == "$torch_before" ]] || { say "ERROR: torch changed $torch_before -> $torch_after"; failures+=("torch replaced"); }

# --- 3. what is there, what is skipped and why ----------------------------------------------
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib.util
why = {"tensorrt_llm": "TensorRT-LLM: GBs, NVIDIA's index or container only; its tests skip",
       "transformer_engine": "Transformer Engine: a CUDA build of hundreds of MiB; the TE-spec checks skip",
       "pytriton": "PyTriton: ships tritonserver and needs numpy<2; the critic's tests do not run here"}
for mod in ("megatron.core", "pydantic", "zarr", "transformers", "tensorrt_llm", "transformer_engine", "pytriton",
            "ray"):
    found = importlib.util.find_spec(mod.split(".")[0]) is not None
    print(f"{mod}: {'present' if found else 'SKIPPED, not installed' + (' (' + why[mod] + ')' if mod in why else '')}")
EOF
have() { "$PY" -c "import importlib.util as u, sys; sys.exit(not u.find_spec('$1'))" 2>/dev/null; }
if ! have megatron || ! have pydantic; then
    say "megatron-core / pydantic missing: make a wheelhouse (tests/gpu/make_wheelhouse.sh DIR) and pass --wheelhouse DIR"
    failures+=("dependencies missing")
fi

# --- 4. the checks ------------------------------------------------------------------------------
installed_api=$(mktemp --suffix=.json)
cp tests/fixtures/gpu_api.json "$installed_api"
for pkg in tensorrt_llm transformer_engine megatron; do
    if have "$pkg"; then
        say "extract_api $pkg (installed) --check"
        run 60 "$PY" tests/gpu/extract_api.py --package "$pkg=installed" --check || say "$pkg differs from the fixture (see $LOG)"
        run 60 "$PY" tests/gpu/extract_api.py --package "$pkg=installed" --out "$installed_api" || failures+=("extract $pkg")
    fi
done
if have pytest; then
    GPU_API_FIXTURE=$installed_api run 120 "$PY" -m pytest -q -p no:cacheprovider tests/unit/generation/test_trtllm_engine.py \
        || failures+=("our calls vs installed packages")
fi

figures=$(mktemp --suffix=.json)
say "gpu_checks.py (one process, cuda:0)"
run 300 "$PY" -W ignore tests/gpu/gpu_checks.py --device cuda --out "$figures" || failures+=("gpu_checks")
grep -E '^CHECK ' "$LOG" | cut -c1-300

markers="gpu"
if ! command -v mpirun >/dev/null; then
    markers="gpu and not mpi"
    say "no mpirun on this machine: tests marked mpi are deselected"
fi
if have pytest; then
    # Only the modules that have gpu tests are collected: a CPU-only module may import what this
    # machine lacks (test_logging's mlflow), and its collection error would fail the run for no
    # GPU reason. Among those, a module importing what the machine lacks must not stop the others.
    mapfile -t gpu_modules < <(grep -rlE --include='test_*.py' 'mark\.gpu|"gpu"' tests | sort)
    say "pytest -m '$markers' over ${#gpu_modules[@]} modules with gpu tests"
    run 300 "$PY" -m pytest -m "$markers" -ra -q -p no:cacheprovider --continue-on-collection-errors \
        "${gpu_modules[@]}" || failures+=("gpu tests")
    grep -E "passed|failed|SKIPPED|FAILED|ERROR" "$LOG" | tail -n 25
fi

trtllm="NA"
if have tensorrt_llm; then
    say "bench_generation --engine trtllm --device cuda"
    if run 240 "$PY" benchmarks/bench_generation.py --engine trtllm --device cuda; then
        trtllm=$(grep -oE 'trtllm_tok_s=[0-9.]+' "$LOG" | tail -n 1 | cut -d= -f2)
    else
        failures+=("trtllm bench")
    fi
fi
say "done in $((SECONDS - START)) s; failures: ${failures[*]:-none}"
line=$("$PY" - "$figures" "${trtllm:-NA}" <<'EOF'
import json, sys
try:
    f = json.load(open(sys.argv[1]))["figures"]
except (OSError, ValueError, KeyError):
    f = {}
fmt = lambda k, spec: "NA" if f.get(k) is None else format(f[k], spec)
print(f"torch_gpu_tok_s={fmt('torch_gpu_tok_s', '.0f')} refit_s={fmt('refit_s', '.4f')} "
      f"grpo_step_s={fmt('grpo_step_s', '.3f')} trtllm_tok_s={sys.argv[2]}")
EOF
)
echo "${line:-$NA_LINE}"
((${#failures[@]} == 0))
