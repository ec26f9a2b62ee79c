"""Which wheels of a wheelhouse run_gpu_checks.sh installs on the GPU machine: stdlib only (it runs
with the machine's own interpreter, before anything is installed).

    python tests/gpu/wheel_select.py DIR      (prints the wheels to install, one a line; says on
                                               stderr which are left out and why)

Left out: the machine's torch stack (torch, nvidia-*, triton: never replaced), and every wheel of
a distribution the machine already has. .gpu-deps goes on PYTHONPATH, before the machine's
site-packages: a copy there would shadow the machine's own (another version of what torch,
transformers and the rest were installed against). The wheelhouse's have-list
(gpu_machine_packages.txt) keeps such wheels out already; this is the check on the machine itself.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

TORCH_STACK = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> set[str]:
    """Canonical names of the distributions this interpreter sees."""
    return {canonical(d.metadata["Name"]) for d in importlib.metadata.distributions() if d.metadata["Name"]}


def split_wheels(wheels: list[Path], have: set[str]) -> tuple[list[Path], dict[Path, str]]:
    """(to install, {left out: why}) for `wheels`, given the machine's distributions `have`."""
    take, leave = [], {}
    for w in sorted(wheels):
        name = canonical(w.name.split("-", 1)[0])
        if TORCH_STACK.match(name):
            leave[w] = "the machine's torch stack is never replaced"
        elif name in have:
            leave[w] = "the machine has it already (a copy on PYTHONPATH would shadow its own)"
        else:
            take.append(w)
    return take, leave


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(f"usage: wheel_select.py WHEELHOUSE_DIR (got {argv})", file=sys.stderr)
        return 2
    take, leave = split_wheels(list(Path(argv[0]).glob("*.whl")), installed())
    for w, why in leave.items():
        print(f"left out {w.name}: {why}", file=sys.stderr)
    for w in take:
        print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
