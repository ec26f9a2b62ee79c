#!/usr/bin/env bash
# Every GPU check in one run, for a machine with NVIDIA GPU(s) and network access to the package
# registries only (Debian/Ubuntu, root or a ready MPI), or an NVIDIA TensorRT-LLM container:
#   1. set-up: OpenMPI (apt, when missing), a venv .venv-gpu that also sees the system's
#      packages (a container's tensorrt_llm / transformer_engine), torch 2.13.0 (PyPI's Linux
#      wheel is the CUDA build), the package with its test and bench extras;
#   2. TensorRT-LLM 1.2.1 and Transformer Engine are used when importable. The registry holds
#      only a stub of tensorrt-llm (it downloads the real wheel from NVIDIA's index) and TE's
#      torch part is a source build, so neither is forced: their tests skip with the reason;
#   3. the API fixture checked against the installed packages (tests/gpu/extract_api.py --check),
#      every gpu-marked test, then benchmarks/bench_generation.py --engine trtllm --device cuda.
# Each step gets what is left of a 10-minute budget. The last line holds the figures:
#   trtllm_tok_s=... torch_gpu_tok_s=... refit_s=... refit_over_step=...   (NA: not measured)
#
#     bash tests/gpu/run_gpu_checks.sh          (full log: gpu_checks.log)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
BUDGET_S=${GPU_CHECK_BUDGET_S:-590}
LOG=${GPU_CHECK_LOG:-gpu_checks.log}
START=$SECONDS
: >"$LOG"
say() { echo "[gpu-checks $((SECONDS - START))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET_S - (SECONDS - START))); }
# run LIMIT_S CMD...: the command under `timeout`, its output appended to the log.
run() {
    local limit=$1
    shift
    local cap
    cap=$(left)
    ((limit > cap)) && limit=$cap
    if ((limit < 10)); then
        say "skipped (budget spent): $*"
        return 124
    fi
    timeout "$limit" "$@" >>"$LOG" 2>&1
}
failures=()

# --- 1. set-up --------------------------------------------------------------------------
command -v nvidia-smi >/dev/null && nvidia-smi -L | tee -a "$LOG"
if ! command -v mpirun >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        say "apt-get install openmpi-bin libopenmpi-dev"
        run 120 apt-get update -q && DEBIAN_FRONTEND=noninteractive run 120 apt-get install -y -q \
            --no-install-recommends openmpi-bin libopenmpi-dev || failures+=("apt-get openmpi")
    else
        say "no mpirun and no root apt-get: the MPI tests will fail"
    fi
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=.venv-gpu/bin/python
[[ -x $PY ]] || run 60 python3 -m venv --system-site-packages .venv-gpu || failures+=("venv")
PIP=("$PY" -m pip install --disable-pip-version-check -q)
if ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    say "pip install torch==2.13.0 (CUDA build)"
    run 300 "${PIP[@]}" torch==2.13.0 || failures+=("torch")
fi
say "pip install -e .[test,bench]"
run 200 "${PIP[@]}" -e '.[test,bench]' || failures+=("pip install")
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib.util, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {torch.cuda.device_count()}")
for pkg in ("tensorrt_llm", "transformer_engine", "ray"):
    print(f"{pkg}: {'present' if importlib.util.find_spec(pkg) else 'absent (its tests skip)'}")
EOF
if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(not u.find_spec("tensorrt_llm"))'; then
    say "pip install tensorrt-llm==1.2.1 (the registry has only a stub that fetches NVIDIA's wheel: may fail here)"
    run 240 "${PIP[@]}" "tensorrt-llm==1.2.1" "ray[default]" || say "tensorrt-llm not installable from here"
fi

# --- 2. our GPU-only calls against the installed packages' signatures ---------------------
# Differences from the committed fixture are reported; what fails is a call of ours that the
# installed package would reject (the conformance test run on signatures extracted from it).
installed_api=$(mktemp --suffix=.json)
cp tests/fixtures/gpu_api.json "$installed_api"
for pkg in tensorrt_llm transformer_engine megatron; do
    if "$PY" -c "import importlib.util as u, sys; sys.exit(not u.find_spec('$pkg'))"; then
        say "extract_api $pkg (installed)"
        run 60 "$PY" tests/gpu/extract_api.py --package "$pkg=installed" --check || say "$pkg differs from the fixture (see $LOG)"
        run 60 "$PY" tests/gpu/extract_api.py --package "$pkg=installed" --out "$installed_api" || failures+=("extract $pkg")
    fi
done
GPU_API_FIXTURE=$installed_api run 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_api_conformance.py \
    || failures+=("our calls vs installed packages")

# --- 3. gpu-marked tests -----------------------------------------------------------------
say "pytest -m gpu"
run 300 "$PY" -m pytest -m gpu -ra -q -p no:cacheprovider tests || failures+=("gpu tests")
grep -E "passed|failed|skipped|SKIPPED|FAILED|ERROR" "$LOG" | tail -n 25

# --- 4. benchmark ------------------------------------------------------------------------
say "bench_generation --engine trtllm --device cuda"
run 240 "$PY" benchmarks/bench_generation.py --engine trtllm --device cuda || failures+=("bench")
figures=$(grep -E '^trtllm_tok_s=' "$LOG" | tail -n 1)
say "done in $((SECONDS - START)) s; failures: ${failures[*]:-none}"
echo "${figures:-trtllm_tok_s=NA torch_gpu_tok_s=NA refit_s=NA refit_over_step=NA}"
((${#failures[@]} == 0))
