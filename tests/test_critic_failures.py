"""A hung or dead critic: the client errors within the bound, naming host, port and endpoint."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from slurm_align.critic.client import CriticClient, CriticError
from tests.critic_support import CriticProcess, random_batch, write_run_dir

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
