"""The toy component's ranks (tests/support/toy_component.py): rank 0 serves a one-line TCP echo
that answers only a client proving the run's secret, publishes its address as every serving
component does, and ends once the actor has ended. `python -m tests.programs.toy_component --run-dir D`."""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path

if __name__ == "__main__":
    from slurm_align.slurm.preemption import block_term

    block_term()
    from slurm_align.config import load_run_config
    from slurm_align.rundir import RunDir, publish_address, read_run_secret
    from slurm_align.slurm.hetenv import service_host
    from slurm_align.slurm.preemption import enter_role
    from tests.support.toy_component import token

    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    rd = RunDir(Path(parser.parse_args().run_dir))
    run = load_run_config(rd.config)   # imports the plugin: the kind is known here too
    assert "toy" in run.components, run.components
    enter_role("toy", rd)
    secret = read_run_secret(rd)
    server = socket.create_server((service_host("toy", None), 0))
    host, port = server.getsockname()[:2]

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                line = conn.makefile().readline().strip()
                conn.sendall(b"toy ok\n" if line == token(secret) else b"refused\n")

    threading.Thread(target=serve, daemon=True).start()
    publish_address(rd, "toy", host, port, secret)
    print(f"toy: serving on {host}:{port}", flush=True)
    while not (rd.logs / "actor" / "exit_code").exists():   # the job script writes it when the actor ended
        time.sleep(0.2)
    sys.exit(0)
