"""KTO (losses/kto.py) on fixed inputs against a hand computation of its definition (TRL's) in
plain Python floats (fp64, 1e-9): desirable and undesirable rows, their weights, the reference
point z0 from the mismatched pairs (clamped at 0, no gradient), filler rows."""

from __future__ import annotations

import math

import pytest
import torch

from slurm_align.losses.kto import kto_terms
from slurm_align.losses.registry import KTOOptions

LOGRATIO = [0.8, -1.2, 0.3, 2.0]
DESIRABLE = [1.0, 0.0, 1.0, 0.0]


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def hand(beta: float, wd: float, wu: float, mismatched: list[float], real: list[float]) -> list[float]:
    z0 = max(0.0, sum(m * r for m, r in zip(mismatched, real)) / sum(real))
    return [wd * (1 - sig(beta * (lr - z0))) if d else wu * (1 - sig(beta * (z0 - lr)))
            for lr, d in zip(LOGRATIO, DESIRABLE)]


@pytest.mark.parametrize("mismatched", [[0.5, 1.5, -0.2, 0.9], [-3.0, -1.0, 0.5, -0.4]])   # z0 > 0; clamped to 0
@pytest.mark.parametrize("beta, wd, wu", [(0.1, 1.0, 1.0), (0.7, 1.5, 0.6)])
def test_kto_equals_the_hand_computation(mismatched: list[float], beta: float, wd: float, wu: float):
    opts = KTOOptions(beta=beta, desirable_weight=wd, undesirable_weight=wu)
    real = [1.0, 1.0, 1.0, 0.0]   # the last row is filler: it does not move z0
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    logratio = t(LOGRATIO).requires_grad_()
    mism = t(mismatched).requires_grad_()
    loss, z0 = kto_terms(logratio, mism, t(DESIRABLE), t(real), opts)
    expected = hand(beta, wd, wu, mismatched, real)
    for i in range(3):
        assert float(loss[i]) == pytest.approx(expected[i], rel=1e-9, abs=1e-12)
    assert float(z0) == pytest.approx(max(0.0, sum(mismatched[:3]) / 3), rel=1e-12, abs=1e-15)
    loss[:3].sum().backward()
    assert mism.grad is None or float(mism.grad.abs().sum()) == 0.0   # z0 carries no gradient
    assert float(logratio.grad[0]) < 0 < float(logratio.grad[1])      # desirable up, undesirable down
