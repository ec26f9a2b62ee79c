#!/usr/bin/env bash
# The oldest torch and transformers setup.cfg admits, checked for real: a second venv
# (.venv-oldest) holding them, everything else seen from CI's .venv (a .pth line placed AFTER
# the oldest ones are installed, so they come first on sys.path and pip never touches .venv),
# the package imported from this checkout, and a chosen set of CPU tests run in it.
#
#     bash benchmarks/check_oldest_supported.sh          (nice'd; minutes on 2 cores)
#
# OLDEST_TORCH (default 2.9.1: TensorRT-LLM 1.2.1's floor, the oldest torch setup.cfg's range
# meets it at) must be a CPU build: CUDA builds need GBs of nvidia-* wheels. PyPI's Linux x86_64
# torch wheels are CUDA builds, so a CPU build is looked for on TORCH_INDEX (default PyTorch's
# CPU index). When none can be fetched the check says so and runs with CI's torch, checking
# the oldest transformers only (printed in the last line: torch_checked=...).
# OLDEST_TRANSFORMERS defaults to 4.57.3 (TensorRT-LLM 1.2.1's pin; setup.cfg admits >=4.57).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
OLDEST_TORCH=${OLDEST_TORCH:-2.9.1}
OLDEST_TRANSFORMERS=${OLDEST_TRANSFORMERS:-4.57.3}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
VENV=${OLDEST_VENV:-.venv-oldest}
TESTS=(tests/unit/test_requirements.py tests/unit/models/test_chat_template.py tests/integration/test_hf_models.py
       tests/integration/test_generation_hf.py tests/unit/generation/test_torch_engine.py
       tests/integration/test_generation_trtllm.py tests/unit/models/test_cpu_compat.py)
say() { echo "[oldest] $*"; }
BASE=.venv/bin/python
[[ -x $BASE ]] || { say "no .venv: run .ci/setup.sh first"; exit 1; }

rm -rf "$VENV"
python3 -m venv "$VENV" || exit 1
PY=$VENV/bin/python
PIP=("$PY" -m pip install --disable-pip-version-check -q)
# CI's pins for everything but the packages under test (numpy<2 stays, as PyTriton needs it).
cons=$(mktemp)
grep -vE '^(torch|transformers|tokenizers|safetensors)==' .ci/constraints.txt >"$cons"

torch_checked="$OLDEST_TORCH+cpu"
wheels=$(mktemp -d)
if nice "$PY" -m pip download --disable-pip-version-check -q --no-deps -d "$wheels" --index-url "$TORCH_INDEX" \
        "torch==$OLDEST_TORCH+cpu" 2>"$wheels/err"; then
    say "torch $OLDEST_TORCH+cpu from $TORCH_INDEX"
    nice "${PIP[@]}" -c "$cons" "$wheels"/torch-*.whl || exit 1
else
    torch_checked="$($BASE -c 'import torch; print(torch.__version__)') (CI's: no CPU build of $OLDEST_TORCH reachable)"
    say "no CPU build of torch $OLDEST_TORCH from $TORCH_INDEX ($(tail -n 1 "$wheels/err")); PyPI's is a CUDA build."
    say "checking transformers $OLDEST_TRANSFORMERS with torch $torch_checked"
fi
say "pip install transformers==$OLDEST_TRANSFORMERS (and the tokenizers / huggingface-hub it takes)"
nice "${PIP[@]}" -c "$cons" "transformers==$OLDEST_TRANSFORMERS" pytest pytest-timeout || exit 1
# Everything else from CI's venv, after this venv's own packages on sys.path.
"$BASE" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
    >"$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_ci_venv.pth"
PYTHONPATH=$REPO "$PY" - <<'PYEOF' || exit 1
import torch, transformers, tokenizers, slurm_align
print(f"[oldest] in {__import__('sys').prefix}: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"tokenizers {tokenizers.__version__}, slurm_align from {slurm_align.__file__}")
PYEOF
start=$SECONDS
PYTHONPATH=$REPO nice -n 10 "$PY" -m pytest -q -p no:cacheprovider -m "not gpu and not slurm" "${TESTS[@]}" 2>&1 |
    tee "$VENV/pytest.log" | tail -n 15
rc=${PIPESTATUS[0]}
summary=$(grep -E '[0-9]+ (passed|failed)' "$VENV/pytest.log" | tail -n 1)
echo "oldest_supported rc=$rc torch_checked=\"$torch_checked\" transformers=$OLDEST_TRANSFORMERS tests=\"$summary\" seconds=$((SECONDS - start))"
exit "$rc"
