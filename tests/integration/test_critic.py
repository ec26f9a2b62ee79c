"""The critic over a real PyTriton server (one rank), shared by the tests of this module."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from slurm_align.critic.client import CriticClient, CriticError, CriticUnavailableError
from tests.support.critic_support import CriticProcess, client_for, random_batch, run_child, write_run_dir


@pytest.fixture(scope="module")
def critic(tmp_path_factory):
    run_dir = write_run_dir(tmp_path_factory.mktemp("critic"))   # port 0: the critic picks one
    proc = CriticProcess(run_dir)
    client = client_for(run_dir)
    try:
        proc.wait_ready()
        client.connect()
    except AssertionError:
        proc.stop()
        raise
    yield client, run_dir, proc
    client.close()
    proc.stop()


def test_infer_equals_local_forward_and_save_load_reproduces(critic):
    client, run_dir, _ = critic
    rng = np.random.default_rng(1)
    tokens, lengths = random_batch(rng, 5, 17)
    values, rewards, compute_ms = client.infer(tokens, lengths, timing=True)
    assert compute_ms > 0
    assert values.shape == (5, 17) and values.dtype == np.float32
    assert rewards.shape == (5,) and rewards.dtype == np.float32
    written = client.save("test_ckpt.pt")
    assert written == str(run_dir / "checkpoints" / "critic" / "test_ckpt.pt")
    np.savez(run_dir / "in.npz", tokens=tokens, lengths=lengths)
    run_child("reference", str(run_dir), written, str(run_dir / "in.npz"), str(run_dir / "ref.npz"))
    ref = np.load(run_dir / "ref.npz")
    inside = np.arange(values.shape[1])[None, :] < lengths[:, None]   # past a sequence's end: no value (packed)
    np.testing.assert_allclose(values * inside, ref["values"] * inside, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(rewards, ref["rewards"], atol=1e-5, rtol=1e-5)


def test_train_lowers_value_loss_on_fixed_batch(critic):
    client, _, _ = critic
    rng = np.random.default_rng(2)
    tokens, lengths = random_batch(rng, 4, 12)
    returns = rng.normal(1.0, 0.5, size=(4, 12)).astype(np.float32)
    mask = (np.arange(12)[None, :] < lengths[:, None]).astype(np.float32)
    before, _ = client.infer(tokens, lengths)
    losses = [client.train(tokens, lengths, returns, before, mask) for _ in range(6)]
    assert all(np.isfinite(losses))
    # The first loss is the unclipped masked MSE/2 of the untrained values (v == v_old).
    expected0 = float((0.5 * (before - returns) ** 2 * mask).sum() / mask.sum())
    assert losses[0] == pytest.approx(expected0, rel=1e-4)
    assert losses[-1] < 0.8 * losses[0], losses
    after, _ = client.infer(tokens, lengths)
    assert not np.allclose(after, before)


def test_a_request_leaves_the_headers_it_shares_with_concurrent_requests_unchanged(critic):
    """tritonclient writes a request's Inference-Header-Content-Length into the headers dict it
    is given. Given the client's one dict, concurrent requests raced on it: a request went out
    with another's length and Triton refused it ("failed to parse the request JSON buffer", the
    64-future test below, once in eight suite runs). Deterministic here: the shared headers
    after a request are the run's credentials only."""
    client, _, _ = critic
    before = dict(client._headers)
    client.infer(*random_batch(np.random.default_rng(5), 2, 7))
    assert client._headers == before


def test_64_concurrent_futures_are_matched_to_their_requests(critic):
    client, _, _ = critic
    rng = np.random.default_rng(3)
    batches = [random_batch(rng, 2, int(rng.integers(4, 21))) for _ in range(64)]
    futures = [client.infer_async(t, ln) for t, ln in batches]
    results = [f.result(timeout=120) for f in futures]
    # One padded infer of all rows is the reference (causal attention: padding is inert).
    width = max(t.shape[1] for t, _ in batches)
    all_tok = np.zeros((128, width), np.int64)
    for i, (t, _) in enumerate(batches):
        all_tok[2 * i:2 * i + 2, :t.shape[1]] = t
    all_len = np.concatenate([ln for _, ln in batches])
    ref_v, ref_r = client.infer(all_tok, all_len)
    for i, ((t, _), (v, r)) in enumerate(zip(batches, results)):
        assert v.shape == t.shape
        np.testing.assert_allclose(v, ref_v[2 * i:2 * i + 2, :t.shape[1]], atol=1e-5, err_msg=f"request {i}")
        np.testing.assert_allclose(r, ref_r[2 * i:2 * i + 2], atol=1e-5, err_msg=f"request {i}")


@pytest.mark.parametrize("endpoint,inputs,expect", [
    ("critic_infer", lambda t, ln: {"tokens": t, "lengths": (ln + 20).reshape(-1, 1)},
     "'lengths' must be in [1, T=8]"),
    ("critic_infer", lambda t, ln: {"tokens": t, "lengths": (ln * 0).reshape(-1, 1)},
     "'lengths' must be in [1, T=8]"),
    ("critic_infer", lambda t, ln: {"tokens": t + 1000, "lengths": ln.reshape(-1, 1)},
     "token ids must be in [0, vocab_size=100)"),
    ("critic_infer", lambda t, ln: {"tokens": np.zeros((3, 70), np.int64), "lengths": np.ones((3, 1), np.int64)},
     "at most max_seq_len=64"),
    ("critic_infer", lambda t, ln: {"tokens": t.astype(np.float32), "lengths": ln.reshape(-1, 1)},
     "expects 'INT64'"),
    ("critic_infer", lambda t, ln: {"tokens": t, "lengths": ln[:2].reshape(-1, 1)},
     "batch size does not match"),
    ("critic_infer", lambda t, ln: {"tokens": t[:, :, None], "lengths": ln.reshape(-1, 1)},
     "Expected [-1,-1]"),
    ("critic_train", lambda t, ln: {"tokens": t, "lengths": ln[:2], **{
        n: np.zeros((3, 8), np.float32) for n in ("returns", "prev_values", "mask")}},
     "expected B=3 (tokens.shape[0]), got 2"),
    ("critic_train", lambda t, ln: {"tokens": t, "lengths": ln, "returns": np.zeros((3, 7), np.float32),
                                    "prev_values": np.zeros((3, 8), np.float32),
                                    "mask": np.ones((3, 8), np.float32)},
     "'returns' must have the shape of tokens [3, 8]; got [3, 7]"),
    ("critic_train", lambda t, ln: {"tokens": t, "lengths": ln, "returns": np.zeros((3, 8), np.float32),
                                    "prev_values": np.zeros((3, 8), np.float32)},
     "critic_train: needs the input(s) mask"),
    ("critic_control", lambda t, ln: {"command": np.array([b"format_disk"], dtype=np.object_)},
     "'command' must be one of critic_train, critic_save, critic_shutdown; got 'format_disk'"),
])
def test_malformed_payloads_are_rejected_with_what_was_expected(critic, endpoint, inputs, expect):
    client, _, _ = critic
    tokens, lengths = random_batch(np.random.default_rng(4), 3, 8)
    with pytest.raises(CriticError) as err:
        client._call(endpoint, inputs(tokens, lengths), {"critic_train": ["loss"], "critic_control": ["ack"]}.get(
            endpoint, ["values"]))
    msg = str(err.value)
    assert expect in msg, msg
    assert f"critic at 127.0.0.1:{client.port}, endpoint {endpoint}" in msg
    # The server survives bad input.
    assert client.infer(tokens, lengths)[0].shape == (3, 8)


def test_unreachable_critic_fails_after_connect_timeout_naming_address():
    # A port this test holds bound but not listening: every connect is refused, and no other
    # process can take the port meanwhile (a port picked free and released could be).
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        client = CriticClient("127.0.0.1", port, secret="s" * 43, connect_timeout_s=1.5, request_timeout_s=5)
        t0 = time.monotonic()
        with pytest.raises(CriticUnavailableError, match=rf"critic at 127.0.0.1:{port}, endpoint health.*1.5 s"):
            client.infer(np.zeros((1, 4), np.int64), np.ones(1, np.int64))
        elapsed = time.monotonic() - t0
        client.close()
    assert elapsed >= 1.5 - 0.05   # it kept retrying for its whole connect timeout
    # Upper bound sized for a loaded 2-core machine (a process can stall for seconds there);
    # a client that ignored its timeout would retry until pytest-timeout.
    assert elapsed < 60


def test_unpublished_critic_fails_after_connect_timeout_naming_the_address_file(tmp_path):
    run_dir = write_run_dir(tmp_path)
    # An address from another submission (another secret) is not taken.
    (run_dir / "critic_address.json").write_text('{"host": "127.0.0.1", "port": 1, "tag": "0"}')
    client = client_for(run_dir, connect_timeout_s=1.0)
    with pytest.raises(CriticUnavailableError, match=r"address not published yet.*no address published in "
                                                     r".*critic_address.json"):
        client.connect()
    client.close()


def test_swapped_models_give_outputs_identical_to_resident_and_init_from_rm_checkpoint(tmp_path):
    run_dir = write_run_dir(tmp_path)
    out = run_child("swap-check", str(run_dir))
    assert "SWAP_OK swaps=5" in out
    assert "INIT_OK" in out
