"""Logits/values with TP=2 and PP=2 equal TP=1 with the same weights; full-weight round trip.

Real megatron-core models on real mpirun ranks (tests/programs/models_worker.py is the rank program),
launched once per session with test_checkpoint's saves and loads (tests/support/layout_runs.py).
"""

from __future__ import annotations

import re

import pytest

from tests.support.layout_runs import LAYOUTS, ROOT, WORKER, LayoutRuns, mpirun

__all__ = ["ROOT", "WORKER", "mpirun"]   # other test files launch their programs with these


@pytest.mark.mpi
def test_tp2_and_pp2_match_tp1(layout_runs: LayoutRuns):
    """LM logits and value-model values, each from the same full weights."""
    for tp, pp in LAYOUTS:
        for kind in ("lm", "value"):
            for rank in range(2):
                path = layout_runs.folder(tp, pp) / f"check_{kind}{rank}.txt"
                text = path.read_text()
                out_err = float(re.search(r"out_err=(\S+)", text).group(1))
                weight_err = float(re.search(r"weight_err=(\S+)", text).group(1))
                init_err = float(re.search(r"init_err=(\S+)", text).group(1))
                assert out_err <= 1e-5, f"{kind} TP={tp} PP={pp} rank {rank}: {text}"
                assert weight_err == 0.0, f"{kind} full_state_dict round trip TP={tp} PP={pp}: {text}"
                assert init_err == 0.0, f"{kind}: same seed, different weights under TP={tp} PP={pp}: {text}"
