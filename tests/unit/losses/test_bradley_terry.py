"""Bradley-Terry (losses/bradley_terry.py) on fixed values against a hand computation (fp64,
1e-9): the reward is the value at each sequence's last token, and rows carrying
chosen_reward / rejected_reward add Llama 2's margin term, scaled by margin_scale."""

from __future__ import annotations

import math

import pytest
import torch

from slurm_align.config.run import ModelConfig
from slurm_align.losses.registry import loss_spec

# values [4 sequences, 5 positions]: chosen 0, chosen 1, rejected 0, rejected 1
VALUES = torch.tensor([[0.1, 0.2, 0.9, 5.0, 5.0], [0.0, -0.4, 0.3, 1.2, 7.0],
                       [0.5, 0.6, -0.8, 9.0, 9.0], [1.0, 0.2, 0.7, 0.4, -3.0]], dtype=torch.float64)
LENGTHS = torch.tensor([3, 5, 3, 4])   # last tokens: 0.9, 7.0, -0.8, 0.4


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


@pytest.mark.parametrize("scale", [0.0, 1.0, 0.5])
def test_bradley_terry_with_and_without_a_margin(scale: float):
    loss = loss_spec("bradley_terry").build(loss_spec("bradley_terry").parse_options({"margin_scale": scale}),
                                            ModelConfig())
    rewards = torch.tensor([3.0, float("nan"), 1.0, float("nan")], dtype=torch.float64)   # pair 1 carries none
    mb = {"lengths": LENGTHS, "real": torch.tensor([1.0, 1.0]), "rewards": rewards, "norm": 2.0}
    value, sums = loss(VALUES, mb)
    expected = -logsig(0.9 - (-0.8) - scale * (3.0 - 1.0)) - logsig(7.0 - 0.4)
    assert float(sums["loss_sum"]) == pytest.approx(expected, rel=1e-9)
    assert float(value) == pytest.approx(expected / 2.0, rel=1e-9)
    assert float(sums["correct"]) == 2.0
