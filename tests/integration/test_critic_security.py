"""The critic on a shared cluster: only its run's actor may call it, it writes only inside the run,
it listens only where it was told, and a stranger's flood does not disturb the run.

The attacks are made as another user of the cluster would make them: raw HTTP requests (KServe v2
JSON), with no secret, a wrong one, or another run's, and with the Triton gate token that other
users of the node can read on tritonserver's command line (that gets past Triton's gate, not
past the critic's own check of the secret).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest

from slurm_align.config import load_profile
from slurm_align.critic import protocol as P
from slurm_align.critic.client import CriticClient, CriticError
from slurm_align.rundir import RunDir, create_run_secret, read_run_secret
from slurm_align.slurm.launch import launch_run
from slurm_align.store.traces import read_traces
from tests.integration.test_ppo import tiny_run
from tests.support.critic_support import CriticProcess, client_for, critic_address, random_batch, write_run_dir

OTHER = "o" * 43   # a well-formed secret of nobody


@pytest.fixture(scope="module")
def critic(tmp_path_factory):
    run_dir = write_run_dir(tmp_path_factory.mktemp("secured"))
    other_run = tmp_path_factory.mktemp("other-run")
    create_run_secret(RunDir(other_run))
    proc = CriticProcess(run_dir)
    client = client_for(run_dir)
    try:
        addr = proc.wait_ready()
        client.connect()
    except AssertionError:
        proc.stop()
        raise
    yield {"run_dir": run_dir, "proc": proc, "client": client, "addr": addr,
           "secret": read_run_secret(RunDir(run_dir)), "other": read_run_secret(RunDir(other_run))}
    client.close()
    proc.stop()


# --- raw HTTP, as a stranger sends it ------------------------------------------------------------

def _tensor(name: str, arr: np.ndarray, dtype: str) -> dict:
    return {"name": name, "shape": list(arr.shape), "datatype": dtype, "data": arr.reshape(-1).tolist()}


REQUESTS = (P.INFER, *P.COMMANDS)   # critic_infer, and critic_control's every command


def well_formed(endpoint: str, save_name: str = "stranger.pt") -> dict:
    """A request the endpoint (critic_infer, or a command of critic_control) would accept from
    its actor."""
    tok = np.arange(8, dtype=np.int64).reshape(2, 4) % 50
    f = np.ones((2, 4), np.float32)
    if endpoint == P.INFER:
        inputs = [_tensor("tokens", tok, "INT64"), _tensor("lengths", np.full((2, 1), 4), "INT64")]
    elif endpoint == P.TRAIN:
        inputs = [_tensor("tokens", tok, "INT64"), _tensor("lengths", np.full(2, 4), "INT64"),
                  *[_tensor(n, f, "FP32") for n in P.TRAIN_FLOAT_INPUTS]]
    elif endpoint == P.SAVE:
        inputs = [{"name": "name", "shape": [1], "datatype": "BYTES", "data": [save_name]}]
    else:
        inputs = []
    if endpoint in P.COMMANDS:
        inputs.append({"name": "command", "shape": [1], "datatype": "BYTES", "data": [endpoint]})
    rid = np.full((2, 1) if endpoint == P.INFER else (1,), 7, np.int64)   # as the actor's client sends it
    return {"inputs": [*inputs, _tensor(P.REQUEST_ID, rid, "INT64")]}


def raw(addr, path: str, body: bytes | None = None, headers: dict | None = None,
        method: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{addr[0]}:{addr[1]}{path}", data=body, headers=headers or {},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def raw_infer(addr, endpoint: str, headers: dict, body: dict | None = None) -> tuple[int, str]:
    model = P.CONTROL if endpoint in P.COMMANDS else endpoint
    return raw(addr, f"/v2/models/{model}/infer", json.dumps(body or well_formed(endpoint)).encode(),
               {"Content-Type": "application/json", **headers})


def stranger_headers(secret: str, other: str) -> dict[str, dict]:
    """Every way a stranger may try; the last three hold the gate token (readable on the node)."""
    gate = {P.GATE_HEADER: P.gate_token(secret)}
    return {"none": {}, "wrong": P.auth_headers(OTHER), "other_run": P.auth_headers(other),
            "secret_without_gate": {P.SECRET_HEADER: OTHER},
            "gate_only": gate, "gate_wrong": {**gate, P.SECRET_HEADER: OTHER},
            "gate_other_run": {**gate, P.SECRET_HEADER: other}}


def files_under(root: Path) -> dict[str, int]:
    """Every file and its modification time, but the critic's log (refusals are logged)."""
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() and p.suffix != ".log"}


# --- tests ----------------------------------------------------------------------------------------

def test_every_endpoint_refuses_strangers_and_nothing_changes(critic, tmp_path):
    client, addr, run_dir = critic["client"], critic["addr"], critic["run_dir"]
    rng = np.random.default_rng(11)
    tokens, lengths = random_batch(rng, 3, 9)
    before, rewards = client.infer(tokens, lengths)
    files = files_under(run_dir.parent)
    outside = tmp_path / "outside.pt"
    for endpoint in REQUESTS:
        for how, headers in stranger_headers(critic["secret"], critic["other"]).items():
            body = well_formed(endpoint, save_name=str(outside)) if endpoint == P.SAVE else None
            status, text = raw_infer(addr, endpoint, headers, body)
            assert status in (400, 403, 500), (endpoint, how, status, text)   # 500: a model refusing
            assert "restricted" in text or "refused" in text, (endpoint, how, text)
            # The run's own actor is served between the strangers' calls.
            np.testing.assert_array_equal(client.infer(tokens, lengths)[0], before)
    # Metadata and model control are gated as well (unloading a model would stop the run).
    for method, path in [("GET", f"/v2/models/{P.INFER}"), ("GET", f"/v2/models/{P.INFER}/config"),
                         ("POST", "/v2/repository/index"), ("POST", f"/v2/repository/models/{P.INFER}/unload"),
                         ("GET", "/v2/models/stats"), ("GET", "/v2/logging")]:
        status, text = raw(addr, path, b"{}" if method == "POST" else None, method=method)
        assert status == 403 and "restricted" in text, (path, status, text)
    # Our own client with another run's secret is refused too, saying why.
    intruder = CriticClient(*addr, secret=critic["other"], connect_timeout_s=10, request_timeout_s=30)
    with pytest.raises(CriticError, match="refused"):
        intruder.infer(tokens, lengths)
    intruder.close()

    after, rewards_after = client.infer(tokens, lengths)
    np.testing.assert_array_equal(after, before)          # no stranger trained the value model
    np.testing.assert_array_equal(rewards_after, rewards)
    assert files_under(run_dir.parent) == files, "a refused request wrote or changed a file"
    assert not outside.exists()
    critic["proc"].check_alive()
    log = Path(critic["proc"].log.name).read_text()
    assert "critic: refused a" in log and "peers connected now" in log   # refusals past the gate are logged


def test_refused_requests_merged_with_the_actors_cannot_fail_them(critic):
    """Only a holder of the gate token (another user of the node) gets past Triton's gate; its
    critic_infer requests may then be merged into one batch with the actor's. They get NaNs, the
    actor's get their values. The merge is made certain: the critic is stopped while everything
    queues in Triton's dynamic batcher, then resumed."""
    client, addr, pid = critic["client"], critic["addr"], critic["proc"].proc.pid
    rng = np.random.default_rng(12)
    batches = [random_batch(rng, 2, 4) for _ in range(8)]   # Triton merges requests of one shape
    reference = [client.infer(t, ln) for t, ln in batches]
    gate_only = {P.GATE_HEADER: P.gate_token(critic["secret"])}
    answers: list = []

    def stranger() -> None:
        status, text = raw_infer(addr, P.INFER, gate_only)
        answers.append((status, json.loads(text)))

    os.kill(pid, signal.SIGSTOP)
    try:
        futures = [client.infer_async(t, ln) for t, ln in batches]
        threads = [threading.Thread(target=stranger) for _ in range(16)]
        for t in threads:
            t.start()
        time.sleep(1.0)   # everything waits in Triton's queue
    finally:
        os.kill(pid, signal.SIGCONT)
    for t in threads:
        t.join()
    for (values, rewards), (ref_values, ref_rewards) in zip([f.result(timeout=60) for f in futures], reference):
        np.testing.assert_allclose(values, ref_values, atol=1e-5)
        np.testing.assert_allclose(rewards, ref_rewards, atol=1e-5)
    merged = [body for status, body in answers if status == 200]
    assert merged, "no stranger's request was merged with the actor's"
    for body in merged:
        outputs = {o["name"]: np.asarray(o["data"], dtype=float) for o in body["outputs"]}
        assert (outputs.pop(P.REQUEST_ID) == -1).all(), body     # its own id is not read either
        assert all(np.isnan(a).all() for a in outputs.values()), body
    assert all("refused" in body["error"] for status, body in answers if status != 200), answers


@pytest.mark.parametrize("name,why", [
    ("ABS", "not a path"), ("../escape.pt", "not a path"), ("sub/../../escape.pt", "not a path"),
    ("link.pt", "is a symlink"), ("iter_0000003.pt", "is a symlink"), ("..", "not a path"), ("", "not a path"),
])
def test_save_writes_only_inside_the_critic_checkpoint_folder(critic, tmp_path, name, why):
    client, run_dir = critic["client"], critic["run_dir"]
    folder = run_dir / "checkpoints" / "critic"
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "victim.pt"
    target.write_bytes(b"precious")
    if name == "ABS":
        name = str(outside / "abs.pt")
    (folder / "link.pt").unlink(missing_ok=True)
    (folder / "link.pt").symlink_to(target)                 # a file symlink leading outside
    (folder / "iter_0000003").unlink(missing_ok=True)
    (folder / "iter_0000003").symlink_to(outside, target_is_directory=True)   # the folder saved beside it
    files = files_under(run_dir.parent)
    with pytest.raises(CriticError, match=f"{P.SAVE}.*{why}"):
        client._call(P.SAVE, {"name": np.array([name.encode()], dtype=np.object_)}, ["path"])
    assert sorted(p.name for p in outside.iterdir()) == ["victim.pt"]
    assert target.read_bytes() == b"precious"
    assert files_under(run_dir.parent) == files
    # A plain name still saves, inside the folder.
    assert Path(client.save("fine.pt")) == folder / "fine.pt"


def test_listens_only_on_the_chosen_address_http_only(critic):
    """tritonserver and everything it starts listen on the published address and nowhere else:
    no gRPC, no metrics port, nothing on 0.0.0.0. (The critic's Python process also listens
    for MPI and torch.distributed, which are not the server's: see bootstrap.py.)"""
    host, port = critic["addr"]
    triton = critic["proc"].triton_processes()
    assert len(triton) == 1, triton
    listening = set()
    for p in [triton[0], *triton[0].children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        listening |= {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    assert listening == {(host, port)}, listening
    # Other users of the node can read tritonserver's command line: the gate token stands
    # there, the run's secret does not.
    cmdline = " ".join(triton[0].cmdline())
    assert P.gate_token(critic["secret"]) in cmdline and critic["secret"] not in cmdline


def test_secret_file_is_private_and_never_elsewhere(critic):
    rd = RunDir(critic["run_dir"])
    assert stat.S_IMODE(rd.secret.stat().st_mode) == 0o600
    assert_secret_only_in_its_file(rd, critic["secret"], extra_logs=[Path(critic["proc"].log.name)])
    # A secret others can read is refused.
    os.chmod(rd.secret, 0o644)
    try:
        with pytest.raises(Exception, match=r"mode 0644.*must be 0600"):
            read_run_secret(rd)
    finally:
        os.chmod(rd.secret, 0o600)


def assert_secret_only_in_its_file(rd: RunDir, secret: str, extra_logs: list[Path] = ()) -> None:
    needle = secret.encode()
    for path in [*rd.root.rglob("*"), *extra_logs]:
        if path.is_file() and path != rd.secret:
            assert needle not in path.read_bytes(), f"the run's secret appears in {path}"


def test_two_critics_share_a_node_and_a_taken_port_fails_at_once(critic, tmp_path):
    second = write_run_dir(tmp_path / "second")
    proc = CriticProcess(second)
    try:
        addr = proc.wait_ready()
        assert addr[1] != critic["addr"][1]
        with client_for(second) as c:
            assert c.infer(*random_batch(np.random.default_rng(3), 2, 5))[0].shape == (2, 5)
    finally:
        proc.stop()
    # A fixed port that is taken (the first critic's): the critic fails at once, saying why.
    taken = write_run_dir(tmp_path / "taken", port=critic["addr"][1])
    proc = CriticProcess(taken)
    try:
        code = proc.wait(timeout=120)   # not the actor's connect timeout: it does not wait at all
    finally:
        proc.stop()
    assert code != 0
    assert f"cannot listen on 127.0.0.1:{critic['addr'][1]}" in proc.log_text()
    assert "critic_server.port to 0" in proc.log_text()
    assert critic_address(taken) is None


# --- a stranger's flood during a PPO run ----------------------------------------------------------

FLOOD = 1000


def tiny_ppo(run_dir: Path, overrides: tuple[str, ...]):
    """The shared reference run's config (conftest `ppo_reference`: static prompts, 4 steps, from
    the SFT policy): `overrides` are its `ppo_reference.overrides`."""
    return launch_run(tiny_run(*overrides), load_profile("local"), run_dir)


def flood(rd: RunDir, stop: threading.Event, outcomes: list, interval_s: float) -> None:
    """FLOOD bad requests from 8 threads, each pausing `interval_s` between its requests, from the
    moment the critic publishes its address: no or wrong secrets on every endpoint, broken JSON,
    wrong shapes, unknown models, model control; and, as another user of the node who read the
    gate token on tritonserver's command line, with the gate token but without the secret.
    Outcomes: (time_ns, kind, HTTP status or error); kind 0 alone may be answered 200 (NaNs,
    when merged with the actor's requests)."""
    wait_for_address(rd, [])
    addr = tuple(json.loads(rd.critic_address.read_text())[k] for k in ("host", "port"))
    other = P.auth_headers(OTHER)
    gate = {P.GATE_HEADER: P.gate_token(read_run_secret(rd))}
    kinds = [lambda: raw_infer(addr, P.INFER, gate),
             lambda: raw_infer(addr, P.TRAIN, {**gate, P.SECRET_HEADER: OTHER}),
             lambda: raw_infer(addr, P.SHUTDOWN, gate),
             lambda: raw_infer(addr, P.INFER, {}),
             lambda: raw_infer(addr, P.TRAIN, other),
             lambda: raw_infer(addr, P.SAVE, other),
             lambda: raw_infer(addr, P.SHUTDOWN, {}),
             lambda: raw(addr, f"/v2/models/{P.INFER}/infer", b"{not json", {"Content-Type": "application/json"}),
             lambda: raw_infer(addr, P.INFER, other, {"inputs": [{"name": "tokens", "shape": [1, 2, 3],
                                                                   "datatype": "FP32", "data": [1]}]}),
             lambda: raw(addr, "/v2/models/nope/infer", b"{}", other),
             lambda: raw(addr, f"/v2/repository/models/{P.INFER}/unload", b"{}", other)]

    def worker(i: int) -> None:
        for j in range(FLOOD // 8):
            if stop.is_set():
                return
            kind = (i + j) % len(kinds)
            try:
                status, _ = kinds[kind]()
            except OSError as e:   # the run ended and the critic with it
                status = type(e).__name__
            outcomes.append((time.time_ns(), kind, status))
            stop.wait(interval_s)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def wait_for_address(rd: RunDir, when: list) -> None:
    deadline = time.monotonic() + 600
    while not rd.critic_address.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    when.append(time.time_ns())


def critic_spans(rd: RunDir):
    spans = read_traces(rd.traces, {"actor": 2, "critic": 1}).spans
    return spans[spans["component"] == "critic"]


def learning_curve(run_dir: Path) -> list[float]:
    """Per step: the mean reward and the critic's loss (a stranger's update would change it)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [m[k] for m in rows for k in ("train_rollouts/rewards", "train_optim/critic_loss") if k in m]
    assert len(curve) >= 2, rows   # rewards and the critic's loss of at least one step
    return curve


@pytest.mark.timeout(1500)   # waits for the shared reference run too: sized for a loaded machine
def test_flood_of_bad_requests_leaves_the_run_as_it_would_have_been(tmp_path, ppo_reference):
    calm = RunDir(ppo_reference())   # the same run without the flood
    # How long the critic works, from its first span to its last: the flood, from the critic's
    # address on, is spread over about that.
    spans = critic_spans(calm)
    serving_s = (spans["end_ns"].max() - spans["start_ns"].min()) / 1e9

    rd = RunDir(tmp_path / "flooded")
    job = tiny_ppo(rd.root, ppo_reference.overrides)
    stop, outcomes = threading.Event(), []
    # Spread over about the calm run's duration, so that the flood covers the critic's work.
    attacker = threading.Thread(target=flood, args=(rd, stop, outcomes, serving_s * 8 / FLOOD))
    attacker.start()
    try:
        state = job.wait(timeout_s=600)
    finally:
        stop.set()
        attacker.join()
    assert state == "COMPLETED", job.failed_logs()
    assert learning_curve(rd.root) == pytest.approx(learning_curve(calm.root), rel=1e-5, abs=1e-6)
    answered = [(t, s) for t, kind, s in outcomes if isinstance(s, int)]
    assert all(s in (400, 403, 404, 500) for t, kind, s in outcomes if kind and isinstance(s, int)), outcomes
    # The flood reached the critic while it served the actor, not only before or after.
    mine = critic_spans(rd)
    during = [t for t, _ in answered if mine["start_ns"].min() <= t <= mine["end_ns"].max()]
    assert len(during) >= 50, (len(answered), len(during))
    print(f"flood: {len(outcomes)} sent, {len(answered)} answered, {len(during)} while the critic served")
    # The secret was made at submit, private, and is written nowhere else, nor in any log.
    assert stat.S_IMODE(rd.secret.stat().st_mode) == 0o600
    assert_secret_only_in_its_file(rd, read_run_secret(rd))
