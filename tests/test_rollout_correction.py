"""Engine log-probs and rollout correction (algorithms/rollout_correction.py).

- the torch engines' log-probs of the tokens they sampled equal the trainer's recomputed ones
  (a real megatron-core GPT, under mpirun; tests/rollout_logprobs_worker.py);
- each mode's weights, and the policy loss they enter, equal a hand computation of the formulas;
  equal log-probs give weights of exactly 1; the weights carry no gradient;
- one real tiny GRPO run with token_truncate: its metrics and its rollout store.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


WORKER = Path(__file__).with_name("rollout_logprobs_worker.py")


# -- engines against the trainer -------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_vs_trainer(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("lp") / "result.pt"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = ["mpirun", "--oversubscribe", "-n", "1", sys.executable, str(WORKER), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.mpi
def test_engine_logprobs_equal_the_trainers_at_the_sampling_temperature(engine_vs_trainer):
    r = engine_vs_trainer
    m = r["mask"].bool()
    assert int(m.sum()) > 30
    # The engines' log-probs are of the tokens they sampled at temperature 0.7 (top-k/top-p on),
    # and equal pi_old as the trainer recomputes it, and pi_theta as the loss computes it.
    assert (r["engine"][m] - r["old"][m]).abs().max() < 1e-4
    assert (r["naive"][m] - r["old"][m]).abs().max() < 1e-4 and r["same_tokens"]
    assert (r["loss"][m] - r["old"][m]).abs().max() < 1e-4
    # The temperature is not a no-op: at temperature 1 the log-probs are clearly different.
    assert (r["raw"][m] - r["old"][m]).abs().max() > 1e-2
