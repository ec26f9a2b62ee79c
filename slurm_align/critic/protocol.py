"""The critic's wire contract: endpoint names, tensor layouts, and payload validation.

Both sides import this module, so a change of layout is made in one place.

Two Triton models (each one costs its own Python backend process, ~2 s at start and at stop):
    critic_infer    tokens int64 [B,T] (right-padded), lengths int64 [B] (sent as [B,1]:
                    dynamic batching prepends the batch axis to every input)
                    -> values float32 [B,T] (per token), rewards float32 [B] (per sequence),
                       compute_ms float32 [B] (the critic's time on the merged batch, for traces)
    critic_control  command bytes [1], one of the commands below, with that command's inputs:
      critic_train    tokens int64 [B,T], lengths int64 [B], returns float32 [B,T],
                      prev_values float32 [B,T], mask float32 [B,T] -> loss float32 [1]
      critic_save     name bytes [1] -> path bytes [1], returned once the checkpoint is durable. A
                      checkpoint name, not a path: the critic writes only inside its run's
                      checkpoints/critic folder.
      critic_shutdown -> ack int64 [1]; the critic stops after answering
    critic_infer and critic_train also take an optional `step` int64 (the actor's PPO step; [B,1]
    resp. [1]) that labels the critic's trace spans.
    Every request may carry `request_id` int64 ([B,1] for critic_infer, [1] for critic_control),
    and every reply echoes it as the output `request_id` (-1 when the request had none), beside
    the answer it labels: the client takes only a reply that carries its own request's id. (A
    reply of a request the client gave up on, delivered late, must not become the next request's
    answer, whichever layer mixed them up.) critic_train's request_id also keeps a retried
    optimizer step from being applied twice.

Every request carries two headers (see server.py for why two):
    triton-access-token   gate_token(secret): Triton itself refuses requests without it
    x-slurm-align-secret  the run's secret, checked by the critic before anything else
"""

from __future__ import annotations

import hashlib
import hmac
import re

import numpy as np

INFER = "critic_infer"
CONTROL = "critic_control"
ENDPOINTS = (INFER, CONTROL)   # the Triton models
TRAIN = "critic_train"         # critic_control's commands
SAVE = "critic_save"
SHUTDOWN = "critic_shutdown"
COMMANDS = {TRAIN: ("tokens", "lengths", "returns", "prev_values", "mask"), SAVE: ("name",), SHUTDOWN: ()}
"""Each command of critic_control with the inputs it needs."""

TRAIN_FLOAT_INPUTS = ("returns", "prev_values", "mask")
REQUEST_ID = "request_id"
"""The input every request carries and the output every reply echoes."""

GATE_HEADER = "triton-access-token"   # PyTriton's name for Triton's restricted-API header
SECRET_HEADER = "x-slurm-align-secret"
CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def gate_token(secret: str) -> str:
    """Triton's own access token, derived from the run's secret. It appears on tritonserver's
    command line (readable by other users of the node), so it must not be the secret itself."""
    return hmac.new(secret.encode(), b"slurm-align triton gate", hashlib.sha256).hexdigest()


def auth_headers(secret: str) -> dict[str, str]:
    return {GATE_HEADER: gate_token(secret), SECRET_HEADER: secret}


class CriticAuthError(PermissionError):
    """A request without this run's secret; named in the message like CriticPayloadError."""


class CriticPayloadError(ValueError):
    """A request whose tensors do not match the contract; the message names what was expected.

    The class name is part of the message the client sees (PyTriton forwards the traceback),
    so the client can pick the sentence out of the server's error text.
    """


def _fail(endpoint: str, msg: str) -> None:
    raise CriticPayloadError(f"{endpoint}: {msg}")


def _check_array(endpoint: str, name: str, arr: np.ndarray, dtype: type, ndim: int, expect: str) -> None:
    if arr.dtype != dtype:
        _fail(endpoint, f"'{name}' must be {np.dtype(dtype).name} {expect}; got {arr.dtype.name}")
    if arr.ndim != ndim:
        _fail(endpoint, f"'{name}' must be {expect}; got shape {list(arr.shape)}")


def validate_tokens(endpoint: str, tokens: np.ndarray, lengths: np.ndarray, *,
                    max_seq_len: int, vocab_size: int) -> np.ndarray:
    """Check tokens [B,T] and lengths [B] (or [B,1]); return lengths flattened to [B]."""
    _check_array(endpoint, "tokens", tokens, np.int64, 2, "[B,T]")
    if lengths.ndim == 2 and lengths.shape[1] == 1:
        lengths = lengths[:, 0]
    _check_array(endpoint, "lengths", lengths, np.int64, 1, "[B]")
    b, t = tokens.shape
    if lengths.shape[0] != b:
        _fail(endpoint, f"'lengths' must have one entry per sequence: expected B={b} (tokens.shape[0]), "
                        f"got {lengths.shape[0]}")
    if b < 1 or t < 1:
        _fail(endpoint, f"'tokens' must be non-empty [B,T] with B>=1 and T>=1; got shape {[b, t]}")
    if t > max_seq_len:
        _fail(endpoint, f"'tokens' has T={t} columns but the model accepts at most max_seq_len={max_seq_len}")
    bad = np.flatnonzero((lengths < 1) | (lengths > t))
    if bad.size:
        i = int(bad[0])
        _fail(endpoint, f"'lengths' must be in [1, T={t}] (T = tokens.shape[1]); got {int(lengths[i])} "
                        f"at row {i}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        _fail(endpoint, f"token ids must be in [0, vocab_size={vocab_size}); got values in [{lo}, {hi}]")
    return lengths


def validate_train(tokens: np.ndarray, lengths: np.ndarray, floats: dict[str, np.ndarray], *,
                   max_seq_len: int, vocab_size: int) -> np.ndarray:
    """Check a critic_train payload; returns, prev_values and mask must be float32 like tokens."""
    lengths = validate_tokens(TRAIN, tokens, lengths, max_seq_len=max_seq_len, vocab_size=vocab_size)
    for name in TRAIN_FLOAT_INPUTS:
        arr = floats[name]
        _check_array(TRAIN, name, arr, np.float32, 2, f"[B,T]={list(tokens.shape)} like tokens")
        if arr.shape != tokens.shape:
            _fail(TRAIN, f"'{name}' must have the shape of tokens {list(tokens.shape)}; got {list(arr.shape)}")
        if not np.isfinite(arr).all():
            _fail(TRAIN, f"'{name}' must be finite; got NaN or inf")
    if float(floats["mask"].sum()) <= 0:
        _fail(TRAIN, "'mask' selects no position (its sum must be > 0)")
    return lengths


def validate_command(raw: np.ndarray, given: set[str]) -> str:
    """critic_control's `command`: one of COMMANDS, sent with every input that command needs."""
    raw = raw.reshape(-1)
    value = raw[0] if raw.size == 1 else None
    name = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    if name not in COMMANDS:
        _fail(CONTROL, f"'command' must be one of {', '.join(COMMANDS)}; got {name[:100]!r}")
    missing = [n for n in COMMANDS[name] if n not in given]
    if missing:
        _fail(name, f"needs the input(s) {', '.join(missing)}")
    return name


def validate_checkpoint_name(raw: np.ndarray) -> str:
    """critic_save's `name`: one plain file name (no folder, no `..`, no absolute path)."""
    raw = raw.reshape(-1)
    if raw.size != 1:
        _fail(SAVE, f"'name' must hold exactly one string; got {raw.size}")
    value = raw[0]
    try:
        name = value.decode() if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        _fail(SAVE, "'name' must be UTF-8 text")
    if not CHECKPOINT_NAME.match(name):
        _fail(SAVE, f"'name' must be a checkpoint name (letters, digits, '.', '_', '-'; no '/', "
                    f"at most 128 characters), not a path; got {name[:200]!r}")
    return name


def pad_concat(batches: list[np.ndarray], fill: int | float = 0) -> np.ndarray:
    """Stack [B_i, T_i] arrays into [sum B_i, max T_i], right-padding shorter rows."""
    t = max(a.shape[1] for a in batches)
    out = np.full((sum(a.shape[0] for a in batches), t), fill, dtype=batches[0].dtype)
    row = 0
    for a in batches:
        out[row:row + a.shape[0], :a.shape[1]] = a
        row += a.shape[0]
    return out
