"""A 2-rank critic (TP=2 or DP=2, under mpirun) serving a 2-rank actor in another process group."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from slurm_align.store.traces import read_traces
from tests.support.critic_support import CriticProcess, run_child, write_run_dir

pytestmark = pytest.mark.mpi

ACTOR = r"""
import sys, numpy as np
from mpi4py import MPI
from slurm_align.critic.client import CriticClient, share_from_source
comm = MPI.COMM_WORLD
run_dir, out = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(6)
tokens = rng.integers(0, 100, size=(5, 11)); lengths = rng.integers(1, 12, size=5)
result = None
if comm.Get_rank() == 0:  # the model-parallel source rank talks to the critic
    c = CriticClient.for_run_dir(run_dir, connect_timeout_s=120, request_timeout_s=60)
    v, r = c.infer(tokens, lengths, step=0)
    mask = np.ones((5, 11), np.float32); ret = np.ones((5, 11), np.float32)
    losses = [c.train(tokens, lengths, ret, v, mask, step=i) for i in range(3)]
    v2, r2 = c.infer(tokens, lengths, step=3)
    ckpt = c.save("mp.pt")
    result = dict(v=v, r=r, v2=v2, r2=r2, losses=losses, ckpt=ckpt)
result = share_from_source(result, mpi_comm=comm)
np.savez(f"{out}.{comm.Get_rank()}.npz", tokens=tokens, lengths=lengths, v=result["v"], r=result["r"],
         v2=result["v2"], r2=result["r2"], losses=np.array(result["losses"]), ckpt=result["ckpt"])
if comm.Get_rank() == 0:
    c.shutdown_critic()
"""


# DP=2 exercises the critic's own row split, gather and gradient sync; TP=2 is megatron's (slow here).
@pytest.mark.parametrize("layout", [{"data_parallel": 2},
                                    pytest.param({"tensor_parallel": 2}, marks=pytest.mark.slow)],
                         ids=["dp2", "tp2"])
def test_two_rank_critic_serves_two_rank_actor(tmp_path, layout):
    run_dir = write_run_dir(tmp_path, critic=layout)   # port 0: the critic publishes its address
    critic = CriticProcess(run_dir, ranks=2)
    try:
        actor = critic.run_alongside(["mpirun", "--oversubscribe", "-n", "2", sys.executable, "-c", ACTOR,
                                      str(run_dir), str(tmp_path / "actor")], timeout=240)
        assert actor.returncode == 0, actor.stdout[-3000:] + critic.log_text()
        assert critic.wait(timeout=60) == 0, critic.log_text()  # both critic ranks shut down cleanly
    finally:
        critic.stop()
    assert critic.log_text().count("shut down after") == 2
    # Every critic rank traced its work under the actor's step numbers.
    spans = read_traces(run_dir / "traces.zarr", {"critic": 2}).spans
    for rank in (0, 1):
        mine = spans[spans["rank"] == rank]
        got = sorted((int(s["step"]), str(s["phase"])) for s in mine)
        assert got == [(0, "critic_infer"), (0, "critic_train"), (1, "critic_train"), (2, "critic_train"),
                       (3, "critic_infer")], got
    r0, r1 = (np.load(tmp_path / f"actor.{i}.npz") for i in range(2))
    for k in ("v", "r", "v2", "losses"):  # the non-source actor rank got the same answers
        np.testing.assert_array_equal(r0[k], r1[k])
    losses = r0["losses"]
    assert losses[-1] < losses[0], losses
    np.testing.assert_array_equal(r0["r"], r0["r2"])  # training never touches the reward model
    # The trained, sharded value model equals a TP=1 model loaded from its checkpoint, on every row
    # (with DP=2 the rows were split over replicas that must have stayed in step).
    np.savez(tmp_path / "in.npz", tokens=r0["tokens"], lengths=r0["lengths"])
    run_child("reference", str(run_dir), str(r0["ckpt"]), str(tmp_path / "in.npz"), str(tmp_path / "ref.npz"))
    ref = np.load(tmp_path / "ref.npz")
    # Inside each sequence (past its end a packed forward gives 0, the reference the padding's value).
    inside = np.arange(r0["v2"].shape[1])[None, :] < np.asarray(r0["lengths"])[:, None]
    np.testing.assert_allclose(r0["v2"][inside], ref["values"][inside], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(r0["r"], ref["rewards"], atol=1e-5, rtol=1e-5)
