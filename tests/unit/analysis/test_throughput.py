"""tokens/s and MFU per step in `slurm-align analyze breakdown`, against the hand formula, on a
synthetic run's real traces and rollouts (the calibration test's writer)."""

from __future__ import annotations

import json

import pytest

from slurm_align.cli import main
from slurm_align.config import RunConfig
from slurm_align.config.profile import ClusterProfile
from tests.unit.planning.test_calibration import synthetic_run

RUN = RunConfig(ppo={"num_rollout_samples": 8}, generation={"max_new_tokens": 32, "prompt_batch_size": 2})
PROFILE = ClusterProfile(kind="local", hardware={"accelerator": "cpu", "peak_tflops": {"fp32": 1.5}})


def hand_flops() -> float:
    """The default tiny model: L=2 layers, h=64, 4 heads (no GQA), ffn 256 (gelu: 2 matrices),
    vocab 260 padded to 320. Weights a token multiplies through: actor L(4h^2 + 2h*ffn) + h*320,
    value model the same with a 1-wide head. A forward over n tokens: 2 N n + 2 L h n^2. Passes:
    actor generate + logprobs + init_logprobs + 3 x train = 6; critic value + reward model +
    3 x train = 5."""
    layers, h = 2, 64
    body = layers * (4 * h * h + 2 * h * 256)
    actor, critic = body + h * 320, body + h * 1
    lengths = [5 + 3, 7 + 12, 6 + 8, 9 + 30] * 2        # the synthetic run's prompts + responses
    fwd = lambda n_params, n: 2 * n_params * n + 2 * layers * h * n * n  # noqa: E731
    return sum(6 * fwd(actor, n) + 5 * fwd(critic, n) for n in lengths)


def test_breakdown_reports_tokens_per_second_and_mfu(tmp_path, capsys):
    assert (RUN.actor.world_size, RUN.critic.world_size, RUN.training.precision) == (1, 1, "fp32")
    synthetic_run(tmp_path / "run", RUN, PROFILE)
    assert main(["analyze", "breakdown", str(tmp_path / "run"), "--format", "json", "--no-plot"]) == 0
    got = json.loads(capsys.readouterr().out)
    peak = 2 * 1.5e12        # two ranks at the profile's peak_tflops.fp32
    for row in got["steps"]:
        assert row["tokens_per_s"] == pytest.approx(160 / row["step_s"], rel=1e-9)
        assert row["mfu"] == pytest.approx(hand_flops() / (row["step_s"] * peak), rel=1e-9)
    assert got["mean_mfu"] == pytest.approx(sum(r["mfu"] for r in got["steps"]) / len(got["steps"]))
    # the table shows them too
    assert main(["analyze", "breakdown", str(tmp_path / "run"), "--no-plot"]) == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text and "MFU" in text


def test_no_profile_no_mfu(tmp_path, capsys):
    synthetic_run(tmp_path / "run", RUN, PROFILE)
    (tmp_path / "run" / "profile.yaml").unlink()
    assert main(["analyze", "breakdown", str(tmp_path / "run"), "--format", "json", "--no-plot"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert "mean_tokens_per_s" in got and "mean_mfu" not in got
