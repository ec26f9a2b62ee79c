"""Sequence packing and token-budget micro-batches (slurm_align/models/packing.py).

The layout and the partition are checked in-process; the model-level equalities (packed and
token-budget forwards equal the padded path's; one optimizer step gives the same weights
however the batch is micro-batched) on real megatron-core models over real mpirun ranks at
TP=1, TP=2 and PP=2 (tests/programs/packing_worker.py is the rank program).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from slurm_align.algorithms.rollout_batch import RolloutBatch
from slurm_align.models.packing import Batching, PackedLayout, balanced_partition, micro_batch_inputs
from tests.integration.test_models_parallel import mpirun as _mpirun

WORKER = Path(__file__).parents[1] / "programs" / "packing_worker.py"


def mpirun(n: int, *args: str, timeout: int = 300):
    return _mpirun(n, *args, timeout=timeout, program=WORKER)


# -- the partition ---------------------------------------------------------------------------------
def test_partition_respects_the_budget_and_balances_tokens():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.geometric(1 / 64, size=64), 512)
    groups = balanced_partition(lengths, 1024)
    flat = np.sort(np.concatenate(groups))
    assert flat.tolist() == list(range(64)), "every sequence in exactly one micro-batch"
    loads = [int(lengths[g].sum()) for g in groups]
    assert max(loads) <= 1024
    assert len(groups) <= -(-int(lengths.sum()) // 1024) + 1, (loads, int(lengths.sum()))
    assert max(loads) - min(loads) <= int(lengths.max()), loads


def test_partition_is_a_pure_function_of_the_lengths():
    """Every rank of a model-parallel group forms the same micro-batches from the same rows."""
    lengths = [5, 5, 5, 9, 1, 1, 30, 5]
    a, b = balanced_partition(lengths, 20), balanced_partition(list(lengths), 20)
    assert [g.tolist() for g in a] == [g.tolist() for g in b]


def test_a_sequence_over_the_budget_gets_a_micro_batch_of_its_own():
    groups = balanced_partition([4, 50, 3, 6], 10)
    assert [1] in [g.tolist() for g in groups]
    others = [g.tolist() for g in groups if g.tolist() != [1]]
    assert sorted(i for g in others for i in g) == [0, 2, 3]
    assert all(sum([4, 50, 3, 6][i] for i in g) <= 10 for g in others)
    with pytest.raises(ValueError, match="max_tokens=0"):
        balanced_partition([1, 2], 0)


def test_batching_by_sample_count_keeps_consecutive_rows():
    assert [g.tolist() for g in Batching(micro_batch_size=3).groups([1] * 7)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [g.tolist() for g in Batching().groups([1] * 4)] == [[0, 1, 2, 3]]


# -- the layout ------------------------------------------------------------------------------------
def test_layout_rows_positions_and_block_diagonal_mask():
    lay = PackedLayout.plan([3, 5, 2])   # width 5: [seq1], [seq0 seq2]
    tokens = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8], [9, 10, 0, 0, 0]])
    rows = lay.pack(tokens, 0)
    assert rows.tolist() == [[4, 5, 6, 7, 8], [1, 2, 3, 9, 10]]
    assert lay.position_ids().tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    mask = lay.attention_mask()[1, 0]
    allowed = (~mask).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    assert lay.cu_seqlens().tolist() == [0, 5, 8, 10]
    back = lay.unpack(rows.float(), 5)
    assert back.tolist() == tokens.float().tolist()


def test_layout_padding_tail_attends_only_to_itself_and_unpack_drops_last():
    lay = PackedLayout.plan([2, 1], width=5, rows=2)   # one row used, one empty row
    assert lay.rows == 2
    assert lay.cu_seqlens().tolist() == [0, 2, 3, 5, 10]
    mask = ~lay.attention_mask()[0, 0]
    assert mask[3].tolist() == [False, False, False, True, False]   # tail starts its own segment
    lp = torch.arange(10.0).reshape(2, 5)[:, :4]
    assert lay.unpack(lp, 1, drop_last=1).tolist() == [[0.0], [0.0]]  # seq 1 has no next-token position
    assert lay.unpack(lp, 2, drop_last=1).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_fixed_shape_micro_batches_share_one_shape():
    tokens = torch.arange(60).reshape(6, 10)
    lengths = torch.tensor([10, 2, 3, 9, 1, 4])
    groups = balanced_partition(lengths, 12)
    packed = micro_batch_inputs(tokens, lengths, groups, pack=True, fixed_shape=True)
    assert len({tuple(mb["tokens"].shape) for mb in packed}) == 1
    padded = micro_batch_inputs(tokens, lengths, groups, pack=False, fixed_shape=True)
    assert len({tuple(mb["tokens"].shape) for mb in padded}) == 1
    assert sorted(int(i) for mb in packed for i in mb["rows"]) == list(range(6))


def test_rollout_micro_batches_packed_carry_their_columns():
    b = RolloutBatch.from_sequences([np.arange(3), np.arange(2), np.arange(4)],
                                    [np.arange(5), np.arange(1), np.arange(2)], 0, index=[0, 1, 2])
    mbs = b.micro_batches(Batching(max_tokens=9, pack=True), samples=["index"])
    got = sorted((int(i), tuple(mb["mask"][j].tolist())) for mb in mbs for j, i in enumerate(mb["index"]))
    assert [g[0] for g in got] == [0, 1, 2]
    assert got[0][1] == (1.0,) * 5 and got[1][1][:1] == (1.0,) and got[2][1][:2] == (1.0, 1.0)
    assert all("packing" in mb for mb in mbs)


# -- the models ------------------------------------------------------------------------------------
def _read(tmp_path: Path, prefix: str, ranks: int) -> list[dict]:
    return [json.loads((tmp_path / f"{prefix}_{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.mpi
@pytest.mark.parametrize("tp,pp", [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow), (1, 2)])
def test_packed_and_token_budget_forwards_equal_the_padded_path(tmp_path: Path, tp: int, pp: int):
    """GPT (learned positions), Llama (RoPE + Llama-3 scaling, GQA, RMSNorm, SwiGLU, tied) and
    Qwen2 (QKV bias) log-probs and values, fp32, on every rank (broadcast over PP)."""
    mpirun(tp * pp, "forward", str(tp), str(pp), str(tmp_path))
    for rank, res in enumerate(_read(tmp_path, "forward", tp * pp)):
        for shape in ("gpt", "llama", "qwen2"):
            assert res[f"{shape}/logprobs/scale"] > 1.0 and res[f"{shape}/values/spread"] > 1e-4, res
            for way in ("budget", "packed", "packed_one", "packed_small"):
                for out in ("logprobs", "values"):
                    err = res[f"{shape}/{out}/{way}"]
                    assert err <= 1e-5, f"{shape} {out} {way} TP={tp} PP={pp} rank {rank}: {err}"


@pytest.mark.mpi
@pytest.mark.parametrize("tp,pp", [(1, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_one_optimizer_step_is_the_same_however_micro_batched(tmp_path: Path, tp: int, pp: int):
    """Weights after one step: sample-count micro-batches vs token budget vs packed, for the
    token-mean and both sequence-mean aggregations (the loss is normalised over the whole
    optimizer batch, never per micro-batch)."""
    mpirun(tp * pp, "step", str(tp), str(pp), str(tmp_path), timeout=600)
    for rank, res in enumerate(_read(tmp_path, "step", tp * pp)):
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            assert res[f"{agg}/moved"] > 1e-3, res   # the step did something
            for way in ("budget", "packed", "packed_small"):
                assert res[f"{agg}/{way}"] <= 1e-6, f"{agg} {way} TP={tp} PP={pp} rank {rank}: {res}"


def test_rope_angles_restart_per_sequence_as_megatron_computes_them():
    """RoPE is relative, so the forward equalities above cannot see where positions start: the
    angles themselves are checked against megatron's own table at each position id."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from slurm_align.models.cpu_compat import apply_cpu_compat
    from slurm_align.models.packing import rope_angles, rope_at_positions
    apply_cpu_compat()
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    lay = PackedLayout.plan([3, 5, 2])
    pos = lay.position_ids()
    table = rope.get_emb(5)[:, 0, 0]                         # [5, 8] for positions 0..4
    got = rope_angles(rope, pos)                            # [width, rows, 1, 8]
    assert torch.equal(got[:, :, 0], table[pos.t()])
    assert not torch.equal(got[3, 1, 0], table[3])          # row 1, column 3 is position 0

    class Model(torch.nn.Module):
        position_embedding_type = "rope"

        def __init__(self):
            super().__init__()
            self.rotary_pos_emb = rope

    m = Model()
    with rope_at_positions(m, pos):
        assert torch.equal(m.rotary_pos_emb(5), got)
    assert torch.equal(m.rotary_pos_emb(5), rope.get_emb(5))   # restored


@pytest.mark.gpu
@pytest.mark.mpi
def test_thd_packed_forward_equals_the_padded_path_on_gpu(tmp_path: Path):
    """With Transformer Engine's layer spec the packed rows go as one THD sequence with
    cu_seqlens (PackedSeqParams); the same equalities as on CPU."""
    pytest.importorskip("transformer_engine")
    mpirun(1, "forward", "1", "1", str(tmp_path))
    res = _read(tmp_path, "forward", 1)[0]
    for shape in ("gpt", "llama", "qwen2"):
        for way in ("budget", "packed", "packed_one"):
            for out in ("logprobs", "values"):
                assert res[f"{shape}/{out}/{way}"] <= 1e-5, (shape, out, way, res)
