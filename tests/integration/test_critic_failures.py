"""A hung or dead critic: the client errors within the bound, naming host, port and endpoint.
A dead or broken tritonserver under a live critic: the critic starts a new one and the
request is answered, a retried optimizer step applied once."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from slurm_align.critic import protocol as P
from slurm_align.critic.client import CriticClient, CriticError
from slurm_align.rundir import RunDir, read_run_secret
from tests.support.critic_support import (
    CHILD_ENV,
    REPO,
    CriticProcess,
    LateReplyProxy,
    random_batch,
    write_run_dir,
)

REQUEST_TIMEOUT_S = 4.0
# Slack over the request timeout, sized for a loaded 2-core machine (other tests' ranks can stall
# this process for seconds); a client without a timeout would hang far past it.
SLACK_S = 20.0


def test_hung_then_killed_critic_gives_clear_errors_within_bound(tmp_path):
    proc = CriticProcess(write_run_dir(tmp_path, request_timeout_s=REQUEST_TIMEOUT_S))   # port 0
    client = CriticClient.for_run_dir(tmp_path, connect_timeout_s=90, request_timeout_s=REQUEST_TIMEOUT_S)
    try:
        _, port = proc.wait_ready()   # the address the critic bound and published
        rng = np.random.default_rng(5)
        tokens, lengths = random_batch(rng, 2, 8)
        assert client.infer(tokens, lengths)[0].shape == (2, 8)

        # Hung: the whole critic (server and tritonserver) is stopped, the socket still accepts.
        proc.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(CriticError, match=rf"critic at 127.0.0.1:{port}, endpoint critic_infer: "
                                               r"request failed after .* \(request_timeout_s=4\)"):
            client.infer(tokens, lengths)
        assert time.monotonic() - t0 < REQUEST_TIMEOUT_S + SLACK_S
        proc.signal(signal.SIGCONT)
        assert client.infer(tokens, lengths)[0].shape == (2, 8)  # it recovers once resumed

        # Dead mid-run: requests go out while the critic is stopped, so none can be answered
        # before the kill lands (no race with the server); each then fails clearly, in time.
        proc.signal(signal.SIGSTOP)
        futures = [client.infer_async(*random_batch(rng, 4, 16)) for _ in range(8)]
        proc.signal(signal.SIGKILL)
        t0 = time.monotonic()
        errors = []
        for f in futures:
            with pytest.raises(CriticError) as caught:
                f.result(timeout=REQUEST_TIMEOUT_S + SLACK_S)
            errors.append(str(caught.value))
        assert time.monotonic() - t0 < REQUEST_TIMEOUT_S + SLACK_S
        with pytest.raises(CriticError, match=rf"critic at 127.0.0.1:{port}, endpoint critic_train"):
            z = np.zeros((2, 8), np.float32)
            client.train(tokens, lengths, z, z, z + 1)
        assert all(f"critic at 127.0.0.1:{port}, endpoint critic_infer" in e for e in errors), errors
    finally:
        client.close()
        proc.stop()


@pytest.fixture(scope="module")
def critic(tmp_path_factory):
    run_dir = write_run_dir(tmp_path_factory.mktemp("restarts"))
    proc = CriticProcess(run_dir)
    client = CriticClient.for_run_dir(run_dir, connect_timeout_s=90, request_timeout_s=60)
    try:
        proc.wait_ready()
        client.connect()
        yield {"run_dir": run_dir, "proc": proc, "client": client}
    finally:
        client.close()
        proc.stop()


def restarts_logged(proc: CriticProcess) -> int:
    return Path(proc.log.name).read_text(errors="replace").count("starting it again")


def test_a_stalled_stub_gets_tritonserver_restarted_and_the_request_answered(critic):
    """A stub stopped past the Python backend's 1 s health deadline: tritonserver answers
    'unhealthy' and is broken from then on (without the restart the retry gets an answer
    with no outputs). The client asks for a restart, the critic starts a new tritonserver on
    the same port, and the request and later ones are answered right."""
    proc, client = critic["proc"], critic["client"]
    rng = np.random.default_rng(21)
    batch, other = random_batch(rng, 2, 8), random_batch(rng, 3, 8)
    reference, other_reference = client.infer(*batch)[0], client.infer(*other)[0]
    before, port = restarts_logged(proc), client.port
    stubs = proc.triton_processes("triton_python_backend_stub", P.INFER)
    assert len(stubs) == 1, stubs
    stubs[0].suspend()
    try:
        answer = client.infer_async(*batch)
        time.sleep(2.5)   # the request waits on the stopped stub past its health deadline
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):   # the restart may have killed it already
            stubs[0].resume()
    np.testing.assert_allclose(answer.result(timeout=120)[0], reference, atol=1e-5)
    np.testing.assert_allclose(client.infer(*other)[0], other_reference, atol=1e-5)
    assert restarts_logged(proc) == before + 1
    assert client.port == port
    assert not stubs[0].is_running()


def test_a_killed_tritonserver_is_started_again_under_the_live_critic(critic):
    proc, client = critic["proc"], critic["client"]
    batch = random_batch(np.random.default_rng(22), 2, 8)
    reference = client.infer(*batch)[0]
    before = restarts_logged(proc)
    (server,) = proc.triton_processes()
    server.kill()
    server.wait(timeout=30)
    np.testing.assert_allclose(client.infer(*batch)[0], reference, atol=1e-5)
    assert restarts_logged(proc) == before + 1
    assert proc.triton_processes()[0].pid != server.pid


def test_a_retried_train_step_is_applied_once(critic):
    """The same critic_train request (one request_id) sent twice, as a retry after a lost
    answer sends it: the second gets the first one's loss and the value model is stepped once;
    a new request_id steps it again."""
    client = critic["client"]
    rng = np.random.default_rng(23)
    tokens, lengths = random_batch(rng, 2, 8)
    z = np.zeros((2, 8), np.float32)
    step = {"tokens": tokens, "lengths": lengths, "returns": z + 1.0, "prev_values": z, "mask": z + 1.0,
            "request_id": np.array([12345], dtype=np.int64)}
    first = client._call(P.TRAIN, step, ["loss"])["loss"]
    values = client.infer(tokens, lengths)[0]
    again = client._call(P.TRAIN, step, ["loss"])["loss"]
    np.testing.assert_array_equal(again, first)
    np.testing.assert_array_equal(client.infer(tokens, lengths)[0], values)
    client._call(P.TRAIN, {**step, "request_id": np.array([12346], dtype=np.int64)}, ["loss"])
    assert not np.allclose(client.infer(tokens, lengths)[0], values)


def test_a_late_reply_is_not_taken_as_the_next_requests_answer(critic):
    """The reply to a request the client gave up on (timed out) comes back on the next request:
    the client sees another request's id in it, discards it and sends its request again, so
    each request gets its own answer. Deterministic: the proxy holds the first reply until the
    next request, whatever the machine's speed (the timeout only ends a wait that nothing ends)."""
    direct = critic["client"]
    rng = np.random.default_rng(24)
    first, second = random_batch(rng, 2, 8), random_batch(rng, 3, 5)
    reference = direct.infer(*second)
    proxy = LateReplyProxy((direct.host, direct.port))
    client = CriticClient("127.0.0.1", proxy.port, secret=read_run_secret(RunDir(critic["run_dir"])),
                          connect_timeout_s=30, request_timeout_s=2)
    try:
        with pytest.raises(CriticError, match=r"endpoint critic_infer: request failed after"):
            client.infer(*first)
        assert proxy.stage == "deliver"      # the first reply is held, for the next request
        values, rewards = client.infer(*second)
        assert proxy.stage == "pass"         # it was delivered, and refused
        assert values.shape == (3, 5) and rewards.shape == (3,)
        np.testing.assert_allclose(values, reference[0], atol=1e-5)
        np.testing.assert_allclose(rewards, reference[1], atol=1e-5)
    finally:
        client.close()
        proxy.close()


DIES_STARTING = Path(__file__).parents[1] / "programs" / "critic_dies_starting_prog.py"


@pytest.mark.parametrize("max_restarts", [1, 0])
def test_a_tritonserver_that_dies_while_starting_is_started_again(tmp_path, max_restarts):
    """CI: under load, tritonserver's Python backend aborted while a model's stub started, and
    the critic failed at start. Now the server starts it again (within ServerLimits.max_restarts:
    with 0 the start fails, naming the error)."""
    out = subprocess.run([sys.executable, str(DIES_STARTING), str(tmp_path / "ck"), str(max_restarts)],
                         cwd=REPO, env={**os.environ, **CHILD_ENV}, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert "died while starting (HTTPConnectionClosed" in text or max_restarts == 0, text[-3000:]
    if max_restarts:
        assert out.returncode == 0, text[-3000:]
        assert re.search(r"^restarts=1 killed=True ready=200 port=\d+ stale=0$", out.stdout, re.M), out.stdout
    else:
        assert out.returncode != 0 and "restarts=" not in out.stdout, text[-3000:]
        assert "HTTPConnectionClosed" in text and "starting it again" not in text, text[-3000:]
