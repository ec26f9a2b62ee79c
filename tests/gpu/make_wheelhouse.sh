#!/usr/bin/env bash
# The wheels an offline GPU machine needs for tests/gpu/run_gpu_checks.sh --wheelhouse DIR.
# Run where the package registry is reachable; copy DIR (at most 40 MiB) with the checkout.
#
#     bash tests/gpu/make_wheelhouse.sh DIR [--have LIST] [--python-version 3.12]
#          [--platform manylinux_2_28_x86_64] [--test-deps pytest,...] [--extras X] [--max-mib 40]
#
# By default only what the GPU checks need: install_requires and, of the test extra, pytest, its
# plugins and transformers (tests/gpu/make_wheelhouse.py: GPU_CHECK_TEST_DEPS); not the rest of
# the test extra (wandb, mlflow, shellcheck: no GPU check uses them). LIST (default
# tests/gpu/gpu_machine_packages.txt, the GPU machine's full package list): what the target
# already has, one `name` or `name==version` a line; nothing on it is brought (a copy would
# shadow the machine's own). Over the limit, nothing is written and the largest wheels are named.
set -euo pipefail
cd "$(dirname "$0")/../.."
[[ $# -ge 1 && $1 != -* ]] || { sed -n '2,13p' "$0"; exit 2; }
PY=${PYTHON:-}
if [[ -z $PY ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
"$PY" -c 'import packaging' 2>/dev/null || { echo "make_wheelhouse: $PY lacks the 'packaging' module" >&2; exit 2; }
exec "$PY" tests/gpu/make_wheelhouse.py "$@"
