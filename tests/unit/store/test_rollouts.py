"""Rollout store: round trip, commit semantics under a real SIGKILL, resume truncation, schema errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import zarr

from slurm_align.store.atomic import AtomicLocalStore
from slurm_align.store.ragged import create, pack, put_chunk, unpack
from slurm_align.store.rollouts import TOKEN_FIELDS, RolloutStore, RolloutStoreError

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def make_batch(seed: int, n: int) -> dict:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 9, n)  # zero-length responses included on purpose
    return {
        "prompt_tokens": [rng.integers(0, 260, rng.integers(1, 6)).tolist() for _ in range(n)],
        "response_tokens": [rng.integers(0, 260, k).tolist() for k in lengths],
        **{f: [rng.standard_normal(k).astype(np.float32) for k in lengths] for f in TOKEN_FIELDS},
        "reward": rng.standard_normal(n).astype(np.float32),
        "is_end": rng.random(n) > 0.3,
        "rank": rng.integers(0, 4, n),
        "version": rng.integers(0, 9, n),
    }


def assert_same(got: dict, batches: list[tuple[int, dict]]) -> None:
    samples = [(step, i, b) for step, b in batches for i in range(len(b["prompt_tokens"]))]
    assert len(got["step"]) == len(samples)
    prompts = unpack(got["prompt_tokens"], got["prompt_offsets"])
    responses = unpack(got["response_tokens"], got["response_offsets"])
    for j, (step, i, b) in enumerate(samples):
        assert got["step"][j] == step
        assert prompts[j].tolist() == list(b["prompt_tokens"][i])
        assert responses[j].tolist() == list(b["response_tokens"][i])
        assert got["length"][j] == len(b["response_tokens"][i])
        a, e = got["response_offsets"][j], got["response_offsets"][j + 1]
        for f in TOKEN_FIELDS:
            np.testing.assert_array_equal(got[f][a:e], b[f][i])
        assert got["reward"][j] == b["reward"][i]
        assert got["is_end"][j] == b["is_end"][i]
        assert got["rank"][j] == b["rank"][i]
        assert got["version"][j] == b["version"][i]


def test_pack_unpack_round_trip():
    seqs = [[1, 2, 3], [], [4]]
    flat, off = pack(seqs, np.int32)
    assert off.dtype == np.int64 and off.tolist() == [0, 3, 3, 4]
    assert [s.tolist() for s in unpack(flat, off)] == seqs


def test_round_trip_and_per_step_reads(tmp_path):
    path = tmp_path / "rollouts.zarr"
    store = RolloutStore.create(path)
    batches = [(s, make_batch(s, 3 + s)) for s in range(3)]
    for step, b in batches:
        store.append_step(step, b)
    reader = RolloutStore.open(path, read_only=True)
    assert reader.num_steps == 3 and reader.num_samples == 3 + 4 + 5
    assert reader.steps.tolist() == [0, 1, 2]
    assert_same(reader.read(), batches)
    assert_same(reader.read(step=1), [batches[1]])
    with pytest.raises(KeyError, match="step 7 is not committed"):
        reader.read(step=7)
    assert reader.step_sizes()["num_samples"].tolist() == [3, 4, 5]
    codec = str(reader.group["tokens"].compressors)
    assert "lz4" in codec and "shuffle" in codec


_KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_rollouts import make_batch
    import slurm_align.store.rollouts as R
    store = R.RolloutStore.create({path!r})
    store.append_step(0, make_batch(0, 4))
    store.append_step(1, make_batch(1, 5))
    real = R.write_row
    def dying_write_row(arr, row, values):
        real(arr, row, values)
        if arr.path == "tokens":   # the tokens row of step 2 is on disk: death before the commit
            os.kill(os.getpid(), signal.SIGKILL)
    R.write_row = dying_write_row
    store.append_step(2, make_batch(2, 7))
    print("not killed")
""")


def test_killed_writer_leaves_previous_steps_and_hides_partial_step(tmp_path):
    path = tmp_path / "rollouts.zarr"
    script = _KILLED_WRITER.format(tests=os.path.dirname(__file__), path=str(path))
    proc = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # The partial step 2 really reached disk (row 2 of the tokens)...
    assert (path / "tokens" / "c" / "2" / "0").is_file()
    store = RolloutStore.open(path)
    # ...but readers only see the two whole steps.
    assert store.num_steps == 2
    assert_same(store.read(), [(0, make_batch(0, 4)), (1, make_batch(1, 5))])
    # The next writer overwrites the remains: no stale tokens leak into step 2.
    redo = make_batch(22, 2)
    store.append_step(2, redo)
    assert_same(RolloutStore.open(path, read_only=True).read(),
                [(0, make_batch(0, 4)), (1, make_batch(1, 5)), (2, redo)])


_LOOPING_WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_rollouts import make_batch
    from slurm_align.store.rollouts import RolloutStore
    store = RolloutStore.create({path!r}, background={background})
    step = 0
    while True:
        store.append_step(step, make_batch(step, 16 + step % 5))
        if step >= 1:   # the previous step is committed once this append returned
            print(step - 1, flush=True)
        step += 1
""")


@pytest.mark.parametrize("background", [False, True])
def test_sigkill_at_an_arbitrary_point_leaves_only_whole_steps(tmp_path, background):
    """A writer appending as fast as it can is SIGKILLed from outside, wherever it is: the store
    opens with whole steps only, each exactly as written, and takes the next step."""
    path = tmp_path / "rollouts.zarr"
    script = _LOOPING_WRITER.format(tests=os.path.dirname(__file__), path=str(path), background=background)
    proc = subprocess.Popen([sys.executable, "-c", script], env=ENV, stdout=subprocess.PIPE, text=True)
    for _ in range(4):   # let it commit a few steps, then kill it mid-flight
        assert proc.stdout.readline(), "writer died on its own"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()
    store = RolloutStore.open(path)
    n = store.num_steps
    assert n >= 4 and store.steps.tolist() == list(range(n))
    written = [(s, make_batch(s, 16 + s % 5)) for s in range(n)]
    assert_same(store.read(), written)
    store.append_step(n, make_batch(99, 3))
    assert_same(RolloutStore.open(path, read_only=True).read(), [*written, (n, make_batch(99, 3))])


def test_direct_chunk_writes_equal_zarrs_own(tmp_path):
    """put_chunk encodes with the array's codecs itself: the file must be byte for byte what
    zarr writes for the same block, and zarr must read it back."""
    group = zarr.open_group(store=AtomicLocalStore(tmp_path / "s.zarr"), mode="a")
    block = np.random.default_rng(0).standard_normal((1, 512)).astype(np.float32)
    ours, theirs = (create(group, name, (4, 512), (1, 512), np.float32) for name in ("ours", "theirs"))
    put_chunk(ours, (2, 0), block)
    theirs[2:3] = block
    key = Path("c") / "2" / "0"
    assert (tmp_path / "s.zarr" / "ours" / key).read_bytes() == (tmp_path / "s.zarr" / "theirs" / key).read_bytes()
    np.testing.assert_array_equal(ours[2:3], block)


def test_background_writes_commit_in_order_and_raise_at_flush(tmp_path, monkeypatch):
    import slurm_align.store.rollouts as R
    store = RolloutStore.create(tmp_path / "r.zarr", background=True)
    batches = [(s, make_batch(s, 3 + s)) for s in range(4)]
    for step, b in batches:
        store.append_step(step, b)   # returns before the files are written
    store.flush()
    assert_same(RolloutStore.open(tmp_path / "r.zarr", read_only=True).read(), batches)
    assert store.steps.tolist() == [0, 1, 2, 3]
    with pytest.raises(RolloutStoreError, match="truncate_to"):
        store.append_step(3, make_batch(9, 1))   # order is still checked at once

    def failing_write_row(*args):
        raise OSError("disk full")
    monkeypatch.setattr(R, "write_row", failing_write_row)
    store.append_step(4, make_batch(4, 2))
    with pytest.raises(OSError, match="disk full"):
        store.flush()
    assert store.steps.tolist() == [0, 1, 2, 3]   # the failed step was never committed
    store.close()


def test_padded_per_token_arrays_are_cut_to_the_response_lengths(tmp_path):
    b = make_batch(5, 6)
    lengths = [len(r) for r in b["response_tokens"]]
    padded = dict(b)
    for f in TOKEN_FIELDS:
        full = np.full((6, max(lengths) + 3), np.nan, dtype=np.float32)
        for i, k in enumerate(lengths):
            full[i, :k] = b[f][i]
        padded[f] = full
    store = RolloutStore.create(tmp_path / "r.zarr")
    store.append_step(0, padded)
    assert_same(store.read(0), [(0, b)])


def test_resume_truncation_no_gaps_no_duplicates(tmp_path):
    store = RolloutStore.create(tmp_path / "r.zarr")
    batches = {s: make_batch(s, 2 + s) for s in range(4)}
    for s in range(4):
        store.append_step(s, batches[s])
    with pytest.raises(RolloutStoreError, match="truncate_to"):
        store.append_step(2, batches[2])  # a duplicate is refused
    store.truncate_to(2)  # resumed from a checkpoint taken after step 1
    assert store.steps.tolist() == [0, 1]
    again = {2: make_batch(102, 3), 3: make_batch(103, 1)}
    store.append_step(2, again[2])
    store.append_step(3, again[3])
    assert store.steps.tolist() == [0, 1, 2, 3]
    assert_same(store.read(), [(0, batches[0]), (1, batches[1]), (2, again[2]), (3, again[3])])
    # Reopening (a new process after resume) sees the same.
    assert RolloutStore.open(tmp_path / "r.zarr").num_samples == 2 + 3 + 3 + 1


def test_schema_errors_name_the_key(tmp_path):
    store = RolloutStore.create(tmp_path / "r.zarr")
    b = make_batch(0, 3)
    del b["reward"]
    with pytest.raises(RolloutStoreError, match=r"lacks key.*reward"):
        store.append_step(0, b)
    b = make_batch(0, 3)
    b["values"][1] = np.zeros(len(b["response_tokens"][1]) + 1)
    with pytest.raises(RolloutStoreError, match="'values': sample 1"):
        store.append_step(0, b)
    b = make_batch(0, 3)
    b["is_end"] = b["is_end"][:2]
    with pytest.raises(RolloutStoreError, match="'is_end' has 2 entries"):
        store.append_step(0, b)
    assert store.num_steps == 0
    with pytest.raises(FileNotFoundError):
        RolloutStore.open(tmp_path / "nothing.zarr")


def test_steps_larger_than_the_first_span_several_chunks(tmp_path):
    """Chunks are sized at the first step; a later, larger step grows the rows and spans several
    chunks; a smaller one after it leaves stale chunks past its end that nobody reads."""
    store = RolloutStore.create(tmp_path / "r.zarr")
    batches = [(0, make_batch(0, 2)), (1, make_batch(1, 400)), (2, make_batch(2, 3))]
    for step, b in batches:
        store.append_step(step, b)
    assert store.group["tokens"].shape[1] > store.group["tokens"].chunks[1]
    reader = RolloutStore.open(tmp_path / "r.zarr", read_only=True)
    assert_same(reader.read(), batches)
    assert_same(reader.read(2), [batches[2]])
