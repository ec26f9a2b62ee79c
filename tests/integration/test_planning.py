"""The step-time plan calibrated on a real finished run: the session's reference PPO run
(conftest `ppo_reference`: 4 steps on the local profile, actor 2 ranks, critic 1)."""

from __future__ import annotations

import numpy as np
import pytest

from slurm_align.analysis.breakdown import compute_breakdown
from slurm_align.analysis.runs import load_run
from slurm_align.planning.calibration import calibrate


def test_the_reference_run_predicts_its_own_step_from_its_calibration(ppo_reference):
    cal = calibrate(ppo_reference(), skip_steps=1)   # step 1 warms up
    pred = cal.predict()
    print(f"measured step {cal.measured_step_s:.3f} s, predicted {pred.step_s:.3f} s (bound by {pred.bounding}); "
          f"measured {cal.measured}; predicted {pred.phases}; efficiencies {cal.costs.efficiency}")
    # Every modelled phase was fitted on this run, so the prediction reproduces it, at an
    # efficiency below the peak; `other` (time outside every span) is fitted from the step.
    for phase in ("generate", "logprobs", "train", "critic_infer", "critic_train"):
        assert pred.phases[phase] == pytest.approx(cal.measured[phase], rel=1e-6), phase
        assert 0 < cal.costs.efficiency[phase] < 1, phase
    # the response-length distribution is the rollouts' (max_new_tokens 8)
    assert len(cal.workload.response_lengths) == len(cal.steps) * cal.run.rollouts_per_step
    assert min(cal.workload.response_lengths) >= 1 and max(cal.workload.response_lengths) <= 8
    # What is derived, not fitted, is the critic's wait. It is not compared with this run's: on
    # this shared 2-core host it follows the scheduling of the critic's and actor's processes,
    # not the overlap the model computes (measured: predicted 0.016-0.045 s against 0.042-0.096 s
    # of a 0.43 s step under load; on an idle host predicted 0 against 0.063 s of 0.27 s). The
    # overlap itself is checked on fixed inputs (tests/unit/planning/test_steptime.py); here only
    # that the derived wait is a wait within the step.
    assert 0 <= pred.phases["critic_wait"] <= cal.measured_step_s
    # and the spans explain most of the step: step by step, each actor rank's time outside every
    # span (the breakdown's idle) is under 40% of the step (measured: 1-16% in two CI runs). Not
    # `other`, the median step less the combination of each phase's median: over 3 steps on a
    # loaded host, a slow save in one step and a slow critic reply in another pull the medians
    # apart, and it read 0.78 of a 1.66 s step (CI) with every second of it inside a span.
    b = compute_breakdown(load_run(ppo_reference()).spans, skip_steps=1)
    actor = {k: v for k, v in b.idle_s.items() if k.startswith("actor/")}
    assert len(actor) == 2
    for rank, idle in actor.items():
        assert np.median(idle / b.step_s) < 0.4, (rank, idle.tolist(), b.step_s.tolist())
    assert 0 <= pred.phases["other"] <= cal.measured_step_s
