"""Helpers for the critic tests: a real critic server in its own process group, and
child-process checks (reference forward, swap check) that need their own MPI/torch world.

Run as a module for the child parts:
    python -m tests.support.critic_support reference RUN_DIR CKPT IN.npz OUT.npz
    python -m tests.support.critic_support swap-check RUN_DIR
    python -m tests.support.critic_support reward-scores RUN_DIR IN.npz OUT.npz
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import yaml

from slurm_align.critic import protocol as P
from slurm_align.critic.client import CriticClient
from slurm_align.rundir import RunDir, address_problem, create_run_secret, read_critic_address, read_run_secret

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 100,
              "max_seq_len": 64}
CHILD_ENV = {"OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
             "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONPATH": str(REPO)}


def write_run_dir(root: Path, *, port: int = 0, critic: dict | None = None, switches: dict | None = None,
                  request_timeout_s: float = 30.0, model: dict | None = None) -> Path:
    """A critic's run directory as `submit` leaves it: config.yaml and the run's secret."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"algorithm": "ppo", "seed": 7, "model": model or TINY_MODEL,
           "critic": critic or {}, "switches": switches or {},
           "ppo": {"critic_lr": 3e-3, "value_clip": 0.2},
           "critic_server": {"port": port, "bind_host": "127.0.0.1", "connect_timeout_s": 90,
                             "request_timeout_s": request_timeout_s}}
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    create_run_secret(RunDir(root))
    return root


def critic_address(run_dir: Path) -> tuple[str, int] | None:
    """The address the run's critic published (None before)."""
    rd = RunDir(run_dir)
    return read_critic_address(rd, read_run_secret(rd))


def client_for(run_dir: Path, **kw) -> CriticClient:
    """The run's own actor's client (its secret, the published address)."""
    return CriticClient.for_run_dir(run_dir, **{"connect_timeout_s": 90, "request_timeout_s": 60, **kw})


class CriticProcess:
    """`launchers/critic.py` (under mpirun when ranks > 1) in its own process group; `component`:
    another kind served by the critic's server (launchers/<component>.py, e.g. the teacher)."""

    def __init__(self, run_dir: Path, ranks: int = 1, component: str = "critic"):
        self.run_dir, self.component = run_dir, component
        cmd = [sys.executable, str(REPO / "launchers" / f"{component}.py"), "--run-dir", str(run_dir)]
        if ranks > 1:
            cmd = ["mpirun", "--oversubscribe", "-n", str(ranks), *cmd]
        self.log = open(run_dir / f"critic-{ranks}.log", "wb")  # noqa: SIM115 open for the critic's life; stop() closes it
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **CHILD_ENV}, start_new_session=True)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=20)
        self.log.close()

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise AssertionError(f"critic exited early with code {code}:\n{self.log_text()}")

    def wait_ready(self, timeout: float = 120) -> tuple[str, int]:
        """Wait for the critic's published address and its health, making sure the critic has not
        died meanwhile; returns (host, port) as the critic published them (it binds port 0)."""
        import urllib.request
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            rd = RunDir(self.run_dir)
            addr = address_problem(rd, self.component, read_run_secret(rd))[0]
            if addr is not None:
                try:
                    with urllib.request.urlopen(f"http://{addr[0]}:{addr[1]}/v2/health/ready", timeout=1) as r:
                        if r.status == 200:
                            return addr
                except OSError:
                    pass
            time.sleep(0.25)
        raise AssertionError(f"critic not ready after {timeout} s:\n{self.log_text()}")

    def run_alongside(self, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
        """Run a client command while watching the critic: fail at once if the critic dies."""
        child = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **CHILD_ENV}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while child.poll() is None:
                if self.proc.poll() not in (None, 0) or time.monotonic() > deadline:
                    os.killpg(child.pid, signal.SIGKILL)
                    out = child.communicate()[0]
                    raise AssertionError(f"client output:\n{out[-3000:]}\ncritic log:\n{self.log_text()}")
                time.sleep(0.25)
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
        return subprocess.CompletedProcess(cmd, child.returncode, child.communicate()[0], "")

    def triton_processes(self, name: str = "tritonserver", model: str | None = None) -> list:
        """tritonserver, or the Python backend stub of one model (name
        triton_python_backend_stub), under this critic."""
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                if p.name() == name and (model is None or f"{model}_0_0" in p.cmdline())]

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]


def _read_http_message(f) -> bytes | None:
    """One HTTP/1.1 request or response from a socket's binary file: its head and its
    Content-Length body (tritonclient and tritonserver send no chunked bodies); None at EOF."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = f.readline()
        if not line:
            return None
        head += line
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
    fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
    assert fields.get(b"transfer-encoding", b"").lower() != b"chunked", head
    return head + f.read(int(fields.get(b"content-length", b"0")))


class LateReplyProxy:
    """A proxy in front of the critic that answers an inference request with the reply of the
    one before it: it withholds the first critic_infer reply (its client times out waiting), and
    hands it, late, to the next critic_infer request in place of that one's own reply. After
    that it passes everything through. The mix-up a client must not fall for, made on demand."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held: bytes | None = None
        self.stage = "withhold"        # -> "deliver" -> "pass"
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client, socket.create_connection(self.upstream) as up, client.makefile("rb") as cf, \
                up.makefile("rb") as uf:
            while (request := _read_http_message(cf)) is not None:
                up.sendall(request)
                reply = _read_http_message(uf)
                if reply is None:
                    return
                if f"/models/{P.INFER}/infer".encode() in request.split(b"\r\n", 1)[0]:
                    with self.lock:
                        stage = self.stage
                        if stage == "withhold":
                            self.held, self.stage = reply, "deliver"
                        elif stage == "deliver":
                            reply, self.stage = self.held, "pass"
                    if stage == "withhold":
                        cf.read()      # no answer: until the client gives up and closes
                        return
                client.sendall(reply)

    def close(self) -> None:
        self.listener.close()


def run_child(*args: str, timeout: float = 120, mpi_ranks: int = 0) -> str:
    cmd = [sys.executable, "-m", "tests.support.critic_support", *args]
    if mpi_ranks:
        cmd = ["mpirun", "--oversubscribe", "-n", str(mpi_ranks), *cmd]
    out = subprocess.run(cmd, cwd=REPO, env={**os.environ, **CHILD_ENV}, capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"child {args[0]} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def random_batch(rng: np.random.Generator, b: int, t: int, vocab: int = 100):
    tokens = rng.integers(0, vocab, size=(b, t), dtype=np.int64)
    lengths = rng.integers(1, t + 1, size=b, dtype=np.int64)
    return tokens, lengths


# --- child processes ------------------------------------------------------------------------

def _single_rank_world(run_dir: Path):
    import torch
    torch.set_num_threads(1)
    from slurm_align.config import load_run_config
    from slurm_align.parallel.bootstrap import init_distributed
    from slurm_align.parallel.layout import initialize_model_parallel
    run = load_run_config(run_dir / "config.yaml")
    env = init_distributed()
    return run, env, initialize_model_parallel(env, 1, 1)


def _reference(run_dir: str, ckpt: str, inp: str, out: str) -> None:
    """Values from a TP=1 value model loaded from CKPT; rewards from the seeded reward model."""
    import torch

    from slurm_align.critic.main import build_models, load_full_weights
    from slurm_align.models.forward import forward_values, last_token_values
    from slurm_align.models.weights import load_full_state_dict

    run, _env, pctx = _single_rank_world(Path(run_dir))
    models = build_models(run, pctx)
    load_full_state_dict(models["value"], pctx, load_full_weights(Path(ckpt)))
    data = np.load(inp)
    tok = torch.from_numpy(data["tokens"])
    values = forward_values(models["value"], pctx, tok)
    rewards = last_token_values(forward_values(models["reward"], pctx, tok), torch.from_numpy(data["lengths"]))
    np.savez(out, values=values.numpy(), rewards=rewards.numpy())


def _reward_scores(run_dir: str, inp: str, out: str) -> None:
    """The reward model's own scores of IN.npz's (tokens, lengths), built as the run's critic
    builds it (seeded, or from critic_model.init_checkpoint), at TP=1: last-token values."""
    import torch

    from slurm_align.critic.main import build_models
    from slurm_align.models.forward import forward_values, last_token_values

    run, _env, pctx = _single_rank_world(Path(run_dir))
    reward = build_models(run, pctx)["reward"]
    data = np.load(inp)
    tok = torch.from_numpy(data["tokens"])
    scores = last_token_values(forward_values(reward, pctx, tok), torch.from_numpy(data["lengths"]))
    np.savez(out, scores=scores.numpy())


def _swap_check(run_dir: str) -> None:
    """Swapped and resident critics give identical outputs; swaps follow the planned order."""
    from slurm_align.critic.channel import Command
    from slurm_align.critic.main import build_models
    from slurm_align.critic.swap import ModelSwap
    from slurm_align.critic.worker import CriticWorker

    run, env, pctx = _single_rank_world(Path(run_dir))
    rng = np.random.default_rng(0)
    tokens, lengths = random_batch(rng, 4, 12)
    train = {"tokens": tokens, "lengths": lengths, "returns": rng.normal(size=(4, 12)).astype(np.float32),
             "prev_values": np.zeros((4, 12), np.float32), "mask": np.ones((4, 12), np.float32)}
    script = ["infer", "infer", "train", "infer", "train", "train", "infer"]
    results = {}
    for keep in (True, False):
        swap = ModelSwap(build_models(run, pctx), keep_resident=keep)
        worker = CriticWorker(swap, pctx, env.comm, lr=1e-2, value_clip=0.2, checkpoint_dir=Path(run_dir))
        outs = []
        for kind in script:
            data = {"tokens": tokens, "lengths": lengths} if kind == "infer" else train
            outs.append(worker.execute(Command(kind, data)))
        results[keep] = (outs, swap.swaps)
    (resident, n_res), (swapped, n_swap) = results[True], results[False]
    assert n_res == 0, n_res
    # Starts with value resident: infer(value,reward)=1, infer(reward,value)=1, train 0,
    # infer 1 (ends on reward), train 1, train 0, infer 1 -> 5 swaps for 4 infers + 3 trains.
    assert n_swap == 5, n_swap
    for kind, a, b in zip(script, resident, swapped):
        if kind == "infer":
            assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]), kind
        else:
            assert a == b, (kind, a, b)
    print(f"SWAP_OK swaps={n_swap}")
    _init_from_reward_checkpoint(run, pctx, Path(run_dir))


def _init_from_reward_checkpoint(run, pctx, run_dir: Path) -> None:
    """A reward model from an RM-trainer checkpoint folder; the value model starts as its copy."""
    import torch

    from slurm_align.critic.main import build_models
    from slurm_align.models.checkpoint import save_checkpoint
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.weights import full_state_dict

    rm = build_gpt(run.critic_model_config, pctx, value_head=True, seed=999)
    save_checkpoint(run_dir / "rm_ckpt", 3, rm, None, {"algorithm": "rm"})
    want = full_state_dict(rm, pctx)
    run.critic_model_config.init_checkpoint = run_dir / "rm_ckpt"
    models = build_models(run, pctx)
    for name in ("reward", "value"):
        got = full_state_dict(models[name], pctx)
        assert got.keys() == want.keys(), name
        assert all(torch.equal(got[k], want[k]) for k in want), name
    print("INIT_OK")


if __name__ == "__main__":
    what, *rest = sys.argv[1:]
    if what == "swap-check":  # torch_dist checkpoint save re-imports __main__: keep this guarded
        _swap_check(*rest)
    elif what == "reward-scores":
        _reward_scores(*rest)
    else:
        _reference(*rest)
