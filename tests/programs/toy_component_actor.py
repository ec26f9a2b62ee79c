"""An actor stand-in for the toy component's tests: reads the toy's published address (only one
this submission published in this start is accepted), asks it once without and once with the
run's secret, records both answers in RUN_DIR/toy_answers.txt, then holds until RUN_DIR/end_actor
exists (the test writes it) so a test can kill the toy while the actor runs."""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import socket
import sys
import time
from pathlib import Path

from slurm_align.rundir import RunDir, address_problem, read_run_secret, write_atomic
from tests.support.toy_component import token

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()


def ask(address: tuple[str, int], line: str) -> str:
    with socket.create_connection(address, timeout=30) as s:
        s.sendall(line.encode() + b"\n")
        return s.makefile().readline().strip()


def main() -> int:
    rd = RunDir(Path(sys.argv[sys.argv.index("--run-dir") + 1]))
    secret = read_run_secret(rd)
    deadline = time.monotonic() + 120
    while (found := address_problem(rd, "toy", secret))[0] is None:
        if time.monotonic() > deadline:
            print(f"ToyLost: {found[1]}", flush=True)
            return 1
        time.sleep(0.2)
    address = found[0]
    assert address is not None
    write_atomic(rd.root / "toy_answers.txt", f"{ask(address, 'no-secret')}\n{ask(address, token(secret))}\n")
    while not (rd.root / "end_actor").exists():
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
