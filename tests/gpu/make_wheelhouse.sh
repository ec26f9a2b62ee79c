#!/usr/bin/env bash
# The wheels an offline GPU machine needs for tests/gpu/run_gpu_checks.sh --wheelhouse DIR.
# Run where the package registry is reachable; copy DIR (at most 60 MiB) with the checkout.
#
#     bash tests/gpu/make_wheelhouse.sh DIR [--have LIST] [--python-version 3.12]
#          [--platform manylinux_2_28_x86_64] [--extras test] [--max-mib 60]
#
# LIST (default tests/gpu/gpu_machine_packages.txt, the GPU machine of shared/STACK.md): what
# the target already has, one `name` or `name==version` a line. Exactly the wheels our
# requirements need beyond it are downloaded, for the target's Python and platform; over the
# limit, nothing is written and the largest wheels are named (tests/gpu/make_wheelhouse.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
[[ $# -ge 1 && $1 != -* ]] || { sed -n '2,11p' "$0"; exit 2; }
PY=${PYTHON:-}
if [[ -z $PY ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
"$PY" -c 'import packaging' 2>/dev/null || { echo "make_wheelhouse: $PY lacks the 'packaging' module" >&2; exit 2; }
exec "$PY" tests/gpu/make_wheelhouse.py "$@"
