"""RolloutBatch: padding, the sequence <-> response mapping, selection, the wire format and
equal-shape micro-batches (single process; the alltoall itself runs in tests/integration/test_balance.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slurm_align.algorithms.rollout_batch import RolloutBatch
from slurm_align.data.datasets import Sequence, response_mask
from slurm_align.data.positions import gather_response, position_mask, response_positions, scatter_positions

PAD = 99


def batch_of(lengths: list[tuple[int, int]], seed: int = 0) -> RolloutBatch:
    """Samples with the given (prompt, response) lengths, token values encoding (sample, position)."""
    prompts = [np.arange(p) + 100 * i for i, (p, _) in enumerate(lengths)]
    responses = [np.arange(p, p + r) + 100 * i for i, (p, r) in enumerate(lengths)]
    b = RolloutBatch.from_sequences(prompts, responses, PAD, index=np.arange(len(lengths)) * 10,
                                    group=np.arange(len(lengths)) // 2, is_end=np.arange(len(lengths)) % 2 == 0)
    rng = np.random.default_rng(seed)
    b.set_tokens("logprobs", torch.from_numpy(rng.normal(size=(b.size, b.max_response)).astype(np.float32)) * b.mask)
    return b


def test_padding_is_right_padding_with_pad_id():
    b = batch_of([(3, 2), (1, 4), (2, 0)])
    assert b.tokens.tolist() == [[0, 1, 2, 3, 4], [100, 101, 102, 103, 104], [200, 201, PAD, PAD, PAD]]
    assert b.prompt_lengths.tolist() == [3, 1, 2] and b.response_lengths.tolist() == [2, 4, 0]
    assert b.max_response == 4
    assert b.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]


def test_response_token_t_is_predicted_at_position_prompt_len_plus_t_minus_1():
    b = batch_of([(3, 2), (1, 4), (2, 1)])
    # A per-position array whose value at position j is the token at position j+1 (what a
    # next-token log-prob is indexed by): mapped back it must give the response tokens themselves.
    shifted = torch.cat([b.tokens[:, 1:], torch.full((b.size, 1), -1)], 1).float()
    got = b.from_positions(shifted)
    for i in range(b.size):
        p, r = int(b.prompt_lengths[i]), int(b.response_lengths[i])
        assert got[i, :r].tolist() == b.tokens[i, p:p + r].float().tolist()
        assert (got[i, r:] == 0).all()
    pos, _mask = response_positions(b.prompt_lengths, b.response_lengths, b.max_response)
    assert pos[0, :2].tolist() == [2, 3] and pos[1].tolist() == [0, 1, 2, 3]


def test_to_positions_inverts_from_positions_and_matches_the_position_mask():
    b = batch_of([(3, 2), (1, 4), (2, 1), (4, 1)])
    on_positions = b.to_positions("logprobs")
    assert on_positions.shape == b.tokens.shape
    assert torch.equal(b.from_positions(on_positions), b["logprobs"])
    assert torch.equal((on_positions != 0).float(), b.position_mask() * (on_positions != 0).float())
    assert b.position_mask().sum(1).tolist() == b.response_lengths.float().tolist()
    # scatter/gather as plain functions on another width
    x = scatter_positions(b["logprobs"], b.prompt_lengths, b.response_lengths, 9)
    assert torch.equal(gather_response(x, b.prompt_lengths, b.response_lengths, b.max_response), b["logprobs"])


def test_the_sft_datasets_response_mask_is_the_same_mapping():
    seqs = [Sequence(list(range(7)), 3), Sequence(list(range(4)), 1), Sequence(list(range(5)), 5)]
    width = 7
    plen = torch.tensor([s.prompt_len for s in seqs])
    rlen = torch.tensor([len(s.ids) - s.prompt_len for s in seqs])
    assert torch.equal(response_mask(seqs, width), position_mask(plen, rlen, width - 1))
    assert response_mask(seqs, width)[0].tolist() == [0, 0, 1, 1, 1, 1]


def test_select_trims_padding_and_sorted_by_orders_rows():
    b = batch_of([(3, 2), (1, 4), (2, 1)])
    s = b.select([2, 0])
    assert s.tokens.shape == (2, 5) and s.max_response == 2
    assert s["index"].tolist() == [20, 0] and s.tokens[0].tolist() == [200, 201, 202, PAD, PAD]
    assert torch.equal(s["logprobs"][1], b["logprobs"][0, :2])
    assert s.sorted_by("index")["index"].tolist() == [0, 20]


def test_pack_unpack_round_trip_over_parts_and_without_tokens():
    b = batch_of([(3, 2), (1, 4), (2, 1), (5, 3)])
    parts = [b.select([3, 1]).pack(), RolloutBatch.empty(PAD).pack(), b.select([0, 2]).pack()]
    back = RolloutBatch.unpack(parts, PAD)
    again = b.select([3, 1, 0, 2])
    assert torch.equal(back.tokens, again.tokens)
    assert torch.equal(back["logprobs"], again["logprobs"]) and torch.equal(back["is_end"], again["is_end"])
    # Padding does not travel: the packed tokens are exactly the real ones.
    assert len(b.pack()["tokens"]) == int(b.seq_lengths.sum())
    cols = RolloutBatch.unpack([b.pack(samples=["index"], per_token=["logprobs"], with_tokens=False)], PAD)
    assert cols.tokens.shape == (4, 0) and set(cols.samples) == {"index"}


def test_merge_matches_rows_by_index():
    b = batch_of([(3, 2), (1, 4), (2, 1)])
    other = b.select([2, 0, 1])
    other.set_samples("reward", torch.tensor([2.0, 0.0, 1.0]))
    other.set_tokens("values", other["logprobs"] * 3)
    b.merge(other)
    assert b["reward"].tolist() == [0.0, 1.0, 2.0]
    assert torch.equal(b["values"], b["logprobs"] * 3)
    with pytest.raises(ValueError, match="different samples"):
        b.merge(b.select([0, 1]))


def test_cat_repads_and_refuses_mismatched_columns():
    a, b = batch_of([(3, 2)]), batch_of([(1, 6), (2, 1)])
    c = RolloutBatch.cat([a, RolloutBatch.empty(PAD), b], PAD)
    assert c.tokens.shape == (3, 7) and c.max_response == 6
    assert c.tokens[0].tolist() == [0, 1, 2, 3, 4, PAD, PAD]
    assert torch.equal(c["logprobs"][0, :2], a["logprobs"][0]) and (c["logprobs"][0, 2:] == 0).all()
    a.set_samples("reward", [1.0])
    with pytest.raises(ValueError, match="columns differ"):
        RolloutBatch.cat([a, b], PAD)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_micro_batches_have_equal_shapes_and_cover_every_row_once(size):
    b = batch_of([(3, 2), (1, 4), (2, 1), (4, 3), (2, 2)])
    mbs = b.micro_batches(size, samples=["is_end", "index"], per_token=["logprobs"])
    assert len(mbs) == -(-b.size // size)
    for mb in mbs:
        assert mb["tokens"].shape == (size, b.tokens.shape[1])
        assert mb["mask"].shape == mb["logprobs"].shape == (size, b.max_response)
    # The filler rows of the last micro-batch have no mask: each real token counts exactly once.
    assert sum(float(mb["mask"].sum()) for mb in mbs) == float(b.response_lengths.sum())
    seen = [int(i) for mb in mbs for i, m in zip(mb["index"], mb["mask"].sum(1)) if m > 0]
    assert seen == [i for i, r in zip(b["index"].tolist(), b.response_lengths.tolist()) if r > 0]


def test_store_columns_are_ragged_per_sample():
    b = batch_of([(3, 2), (1, 4)])
    b.set_samples("reward", [0.5, 1.5])
    cols = b.store_columns(["logprobs"], ["reward", "is_end"])
    assert [x.tolist() for x in cols["prompt_tokens"]] == [[0, 1, 2], [100]]
    assert [x.tolist() for x in cols["response_tokens"]] == [[3, 4], [101, 102, 103, 104]]
    assert [len(x) for x in cols["logprobs"]] == [2, 4]
    assert cols["reward"].tolist() == [0.5, 1.5]


def test_column_shapes_are_checked():
    b = batch_of([(3, 2), (1, 4)])
    with pytest.raises(ValueError, match="token column 'values'"):
        b.set_tokens("values", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="sample column 'reward'"):
        b.set_samples("reward", [1.0, 2.0, 3.0])
    with pytest.raises(KeyError, match="no column 'nope'"):
        b["nope"]
