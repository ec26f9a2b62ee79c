"""The run's optimizer (models/optimizer.build_optimizer) over real gloo ranks: ZeRO-1 takes the
same steps as the replicated optimizer with half the state per rank at DP 2, and its sharded
checkpoint resumes exactly at DP 2 and reshards to DP 1; the critic's ZeRO-1 at DP 2 ends where
DP 1 does (tests/programs/optimizer_worker.py is
the rank program: one tiny megatron GPT, one global batch, 3 steps, the gradient clip acting)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slurm_align.config.memory_plan import plan_model
from slurm_align.config.run import ParallelConfig
from tests.programs.optimizer_worker import MODEL, WAYS
from tests.support.layout_runs import mpirun as run_ranks

WORKER = Path(__file__).parents[1] / "programs" / "optimizer_worker.py"


def mpirun(n: int, *args: str, timeout: int = 240) -> None:
    run_ranks(n, *args, timeout=timeout, program=WORKER)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.mpi
def test_zero1_shards_state_takes_the_same_steps_and_resumes_at_another_dp(tmp_path: Path):
    mpirun(2, "zero1", str(tmp_path))
    r = torch.load(tmp_path / "zero1.pt")
    n = r["fp32"]["numel"]
    # The clip acted (norms above 0.5) and training moved the loss.
    assert min(r["fp32"]["norms"]) > 0.5 and r["fp32"]["losses"][-1] < r["fp32"]["losses"][0] - 0.2
    # Same steps: fp32 ZeRO-1 equals the replicated optimizer (gloo sums two ranks in either
    # collective, so bit-equal here; 1e-6 leaves room for other reduction orders).
    assert max_diff(r["fp32_zero1"]["weights"], r["fp32"]["weights"]) < 1e-6
    assert r["fp32_zero1"]["norms"] == pytest.approx(r["fp32"]["norms"], rel=1e-6)
    assert max_diff(r["bf16_zero1"]["weights"], r["bf16"]["weights"]) < 1e-6
    # State per rank, read from the optimizer's tensors: Adam's moments 8 B/param replicated,
    # half that on each of 2 ZeRO-1 ranks; bf16 adds fp32 main weights, sharded alike.
    for rank in (0, 1):
        assert r["fp32"]["bytes"][rank] == {"moments": 8 * n, "main": 0}
        assert r["bf16"]["bytes"][rank] == {"moments": 8 * n, "main": 4 * n}
        for way in ("fp32_zero1", "bf16_zero1"):
            assert r[way]["bytes"][rank]["moments"] == pytest.approx(4 * n, abs=16)   # padding: < 2 params
            assert r[way]["bytes"][rank]["main"] == pytest.approx(2 * n, abs=8)
    # The memory plan (config/memory_plan.py) says the same bytes for rank 0.
    for way, t in WAYS.items():
        plan = plan_model("m", MODEL, ParallelConfig(data_parallel=2), t)
        assert (plan.optimizer, plan.main_weights) == \
            (r[way]["bytes"][0]["moments"], r[way]["bytes"][0]["main"]), way
    # bf16: parameters bf16, main weights fp32
    assert r["bf16_zero1"]["param_dtypes"] == ["torch.bfloat16"] and r["bf16_zero1"]["main_dtypes"] == ["torch.float32"]

    # Resume before the last step: at DP 2 exactly the uninterrupted step (weights, Adam state,
    # main weights and LR schedule all restored); at DP 1 (state resharded) the same up to bf16
    # rounding of the forward, which now sees the whole batch on one rank.
    last = r["bf16_zero1"]
    same = torch.load(tmp_path / "resume_dp2.pt")
    assert same["step"] == 2 and same["lr_steps"] == 3
    assert same["loss"] == last["losses"][-1] and max_diff(same["weights"], last["weights"]) == 0.0
    mpirun(1, "resume", str(tmp_path))
    one = torch.load(tmp_path / "resume_dp1.pt")
    assert one["loss"] == pytest.approx(last["losses"][-1], rel=1e-5)
    assert one["norm"] == pytest.approx(last["norms"][-1], rel=1e-2)
    assert max_diff(one["weights"], last["weights"]) <= 2 ** -6   # 1 bf16 ulp of weights up to 2

    # The critic (CriticWorker: its value model, ZeRO-1, the clip acting) at DP 2 ends where DP 1
    # ends on the same global batch (fp32: only the order of the gradient sums differs), with
    # half of DP 1's optimizer state (moments and fp32 main-weight shards) on each rank.
    c2, c1 = torch.load(tmp_path / "critic_dp2.pt"), torch.load(tmp_path / "critic_dp1.pt")
    assert c2["losses"] == pytest.approx(c1["losses"], rel=1e-5)
    # Weights: the update (end - start) agrees in norm to 1e-4 (measured: 6.4e-6; a single entry
    # moves up to 1.2e-5 apart where Adam divides a gradient near zero by its own small moment).
    def update_norm(a: dict, b: dict) -> float:
        return sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a) ** 0.5
    assert update_norm(c2["weights"], c1["weights"]) < 1e-4 * update_norm(c1["weights"], c1["start"])
    assert max_diff(c2["start"], c1["start"]) == 0.0 and update_norm(c1["weights"], c1["start"]) > 0.1
    n = c1["numel"]
    assert c1["bytes"] == [{"moments": 8 * n, "main": 4 * n}]
    for rank in (0, 1):
        assert c2["bytes"][rank]["moments"] == pytest.approx(4 * n, abs=16)   # padding: < 2 params
        assert c2["bytes"][rank]["main"] == pytest.approx(2 * n, abs=8)
