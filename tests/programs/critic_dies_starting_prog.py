"""A critic server whose tritonserver is killed while it loads the first model, on the first
start only: as on CI, where a loaded node's Python backend aborted it while a model's stub
started (boost::interprocess::lock_exception). `CriticServer.start` must start it again and
serve; prints `restarts=<n> killed=True ready=<http status> port=<port>` and, in `stale=<n>`,
how many of this process's shared-memory regions no live stub holds (the killed ones').

    python tests/programs/critic_dies_starting_prog.py CHECKPOINT_DIR [MAX_RESTARTS]
"""

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

from slurm_align.critic.server import (
    SHM_MARK,
    STUB,
    TRITON,
    CriticServer,
    ServerLimits,
    children_named,
    kill_all,
    stubs_of_this_process,
)
from slurm_align.launchers import leave

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()

killed: list[int] = []


def kill_tritonserver_when_a_stub_starts(deadline_s: float = 300) -> None:
    """The first model's Python backend stub appears while the load request is in flight."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if children_named(STUB):
            doomed = children_named(TRITON, STUB)   # the stubs too: they hold tritonserver's sockets open
            kill_all(doomed)
            killed.extend(p.pid for p in doomed)
            return
        time.sleep(0.01)


def main() -> None:
    limits = ServerLimits(max_seq_len=16, vocab_size=32, max_restarts=int(sys.argv[2]) if len(sys.argv) > 2 else 5)
    server = CriticServer("127.0.0.1", 0, limits, secret="s" * 32, checkpoint_dir=sys.argv[1])
    threading.Thread(target=kill_tritonserver_when_a_stub_starts, daemon=True).start()
    try:
        server.start()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v2/health/ready", timeout=30) as r:
            regions = {f.name for f in Path("/dev/shm").glob(f"{SHM_MARK}{os.getpid()}-*")}
            held = {a for stub in stubs_of_this_process() for a in stub.cmdline()}
            print(f"restarts={server.restarts} killed={len(killed) > 0} ready={r.status} port={server.port} "
                  f"stale={len(regions - held)}", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
    leave(0)
