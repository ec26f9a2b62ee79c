"""Engine log-probs and rollout correction (algorithms/rollout_correction.py).

- the torch engines' log-probs of the tokens they sampled equal the trainer's recomputed ones
  (a real megatron-core GPT, under mpirun; tests/programs/rollout_logprobs_worker.py);
- each mode's weights, and the policy loss they enter, equal a hand computation of the formulas;
  equal log-probs give weights of exactly 1; the weights carry no gradient;
- the actor's update applies the weights: one PolicyUpdate step on rollouts whose engine
  log-probs are not the trainer's, micro-batched by sample count, token budget and packed, equals
  the corrected step written out by hand (tests/packing_worker.py `corrected`) and not the
  uncorrected one;
- one real tiny GRPO run with token_truncate: its metrics and its rollout store.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurm_align.algorithms import rollout_correction as rc
from slurm_align.algorithms.policy_loss import LossTerms, clipped_policy_loss
from slurm_align.algorithms.rollout_batch import RolloutBatch
from slurm_align.config.run import RolloutCorrectionConfig

WORKER = Path(__file__).parents[1] / "programs" / "rollout_logprobs_worker.py"


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
    # ... so the correction's weights on these rollouts are 1 within float tolerance.
    w = rc.weights("token_mask", r["old"], r["engine"], r["mask"], 2.0)
    assert (w[m] - 1).abs().max() < 1e-3
    # ... so the correction's weights on these rollouts are 1 within float tolerance.
    w = rc.weights("token_mask", r["old"], r["engine"], r["mask"], 2.0)
    assert (w[m] - 1).abs().max() < 1e-3


# -- the weights, by hand ------------------------------------------------------------------------
C = 2.0
# Three sequences of lengths 3, 2, 4 (T = 4); deltas picked to cross every threshold.
LENGTHS = [3, 2, 4]
DELTAS = [[0.1, -0.9, 0.95], [0.9, 0.6], [-0.05, 0.02, -1.0, 0.6]]


def fixed_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log pi_old, log pi_rollout, mask) [3, 4] with log pi_old - log pi_rollout = DELTAS."""
    T = max(LENGTHS)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in LENGTHS])
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(3, T, generator=g) * 3 * mask
    delta = torch.tensor([d + [0.0] * (T - len(d)) for d in DELTAS], dtype=torch.float64)
    return (rollout.double() + delta).float() * mask, rollout, mask


def hand_weights(mode: str) -> list[list[float]]:
    """The issue's formulas, one token at a time in plain floats."""
    out = []
    for d in DELTAS:
        s = sum(d)
        if mode == "none":
            w = [1.0] * len(d)
        elif mode == "token_truncate":
            w = [min(math.exp(x), C) for x in d]
        elif mode == "token_mask":
            w = [math.exp(x) if 1 / C <= math.exp(x) <= C else 0.0 for x in d]
        elif mode == "sequence_truncate":
            w = [min(math.exp(s), C)] * len(d)
        elif mode == "sequence_mask":
            g = math.exp(s / len(d))
            w = [min(math.exp(x), C) for x in d] if 1 / C <= g <= C else [0.0] * len(d)
        out.append(w + [0.0] * (max(LENGTHS) - len(d)))
    return out


MODES = ["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def test_the_registry_has_exactly_the_configs_modes():
    from typing import get_args

    from slurm_align.config.run import RolloutCorrectionMode
    assert list(rc.MODES) == list(get_args(RolloutCorrectionMode)) == MODES


@pytest.mark.parametrize("mode", MODES)
def test_weights_equal_the_formulas(mode):
    old, rollout, mask = fixed_inputs()
    w = rc.weights(mode, old, rollout, mask, C)
    assert torch.allclose(w.double(), torch.tensor(hand_weights(mode), dtype=torch.float64), atol=1e-6), (w, mode)


def test_the_fixed_inputs_exercise_every_branch():
    # (so that the per-mode test above tells the modes apart)
    ratios = [math.exp(x) for d in DELTAS for x in d]
    assert any(r > C for r in ratios) and any(r < 1 / C for r in ratios) and any(1 / C <= r <= C for r in ratios)
    seq = [math.exp(sum(d)) for d in DELTAS]
    assert any(x > C for x in seq) and any(x < C for x in seq)
    g = [math.exp(sum(d) / len(d)) for d in DELTAS]
    assert any(1 / C <= x <= C for x in g) and not all(1 / C <= x <= C for x in g)


@pytest.mark.parametrize("mode", MODES)
def test_equal_logprobs_give_weights_of_exactly_one(mode):
    _, rollout, mask = fixed_inputs()
    w = rc.weights(mode, rollout.clone(), rollout, mask, C)
    assert torch.equal(w, mask)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_the_weights_carry_no_gradient(mode):
    old, rollout, mask = fixed_inputs()
    old, rollout = old.clone().requires_grad_(), rollout.clone().requires_grad_()
    w = rc.weights(mode, old, rollout, mask, C)
    assert not w.requires_grad
    logp = old.detach().clone().requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 0.5, 0.0], [2.0, 1.0, 0.0, 0.0], [-0.5, 1.0, 1.0, -2.0]])
    # the weights flow into the loss only as constants: d loss / d logp is w * the unweighted one
    loss, _ = clipped_policy_loss(logp, old.detach(), adv, mask, LossTerms(), weights=w)
    loss.backward()
    plain = logp.detach().clone().requires_grad_()
    base, _ = clipped_policy_loss(plain, old.detach(), adv, mask, LossTerms())
    base.backward()
    assert torch.allclose(logp.grad, w * plain.grad, atol=1e-7)
    assert old.grad is None and rollout.grad is None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_the_policy_loss_with_weights_equals_the_hand_computation(mode, agg):
    """-w min(r A, clip(r) A) per token, then the aggregation; r = exp(logp - log pi_old)."""
    old, rollout, mask = fixed_inputs()
    w = rc.weights(mode, old, rollout, mask, C)
    logp = old + torch.tensor([[0.3, -0.1, 0.05, 0.0], [-0.4, 0.15, 0.0, 0.0], [0.0, 0.25, -0.3, 0.1]])
    adv = torch.tensor([[1.0, -1.0, 0.5, 0.0], [2.0, 1.0, 0.0, 0.0], [-0.5, 1.0, 1.0, -2.0]])
    terms = LossTerms(eps_low=0.2, eps_high=0.28, agg=agg)
    loss, _ = clipped_policy_loss(logp, old, adv, mask, terms, weights=w)
    hw = hand_weights(mode)
    per_seq = []
    for i, n in enumerate(LENGTHS):
        toks = []
        for t in range(n):
            r = math.exp(float(logp[i, t]) - float(old[i, t]))
            a = float(adv[i, t])
            toks.append(-hw[i][t] * min(r * a, min(max(r, 0.8), 1.28) * a))
        per_seq.append(toks)
    if agg == "token-mean":
        expect = sum(map(sum, per_seq)) / sum(LENGTHS)
    else:
        expect = sum(sum(s) / len(s) for s in per_seq) / len(per_seq)
    assert abs(float(loss) - expect) < 1e-5


# -- the actor's update -------------------------------------------------------------------------------
@pytest.mark.mpi
def test_the_policy_update_applies_the_correction_however_micro_batched(tmp_path):
    """One optimizer step (SGD, lr 1: the weights move by the gradient) of PolicyUpdate with
    token_truncate, on rollouts whose engine log-probs differ from pi_old (weights from about 0.2
    to C, some truncated), through sample-count, token-budget and packed micro-batches: the
    weights after it equal the step computed by hand with the TIS weights (one padded forward,
    the surrogate written out), and differ from the same step without them."""
    import json

    from tests.integration.test_packing import mpirun
    mpirun(1, "corrected", "1", "1", str(tmp_path), timeout=600)
    res = json.loads((tmp_path / "corrected_0.json").read_text())
    assert res["correction_moves_the_step"] > 1e-4, res   # the weights are far from 1: the steps differ
    for way in ("samples", "budget", "packed"):
        assert res[f"{way}/weight_min"] < 0.5 and res[f"{way}/weight_max"] == pytest.approx(2.0), res
        assert res[f"{way}/vs_corrected"] <= 1e-6, f"{way}: {res}"
        assert res[f"{way}/vs_uncorrected"] > 1e-4, f"{way}: {res}"


# -- apply: the batch column and the step's metrics --------------------------------------------------
def batch_with(old: torch.Tensor, rollout: torch.Tensor) -> RolloutBatch:
    b = RolloutBatch.from_sequences([[1, 2]] * 3, [[5] * n for n in LENGTHS], 0)
    b.set_tokens("logprobs", old)
    b.set_tokens("rollout_logprobs", rollout)
    return b


def test_apply_sets_the_column_and_the_metrics_by_hand():
    old, rollout, _ = fixed_inputs()
    b = batch_with(old, rollout)
    m = rc.apply(RolloutCorrectionConfig(mode="token_mask", threshold=C), b, None)
    hw = hand_weights("token_mask")
    flat = [x for i, n in enumerate(LENGTHS) for x in hw[i][:n]]
    assert torch.allclose(b[rc.WEIGHTS], torch.tensor(hw), atol=1e-6)
    assert m["rollout_correction_weight_mean"] == pytest.approx(sum(flat) / len(flat), abs=1e-6)
    assert m["rollout_correction_weight_max"] == pytest.approx(max(flat), abs=1e-6)
    assert m["rollout_correction_zero_token_fraction"] == pytest.approx(flat.count(0.0) / len(flat))
    assert m["rollout_correction_zero_sequence_fraction"] == 0.0   # token_mask drops tokens here, no sequence
    k3 = [math.exp(d) - d - 1 for ds in DELTAS for d in ds]
    assert m["rollout_correction_kl_k3"] == pytest.approx(sum(k3) / len(k3), rel=1e-5)
    # sequence_mask drops whole sequences (here the second): those count as zero sequences
    m = rc.apply(RolloutCorrectionConfig(mode="sequence_mask", threshold=C), b, None)
    assert hand_weights("sequence_mask")[1] == [0.0] * 4
    assert m["rollout_correction_zero_sequence_fraction"] == pytest.approx(1 / 3)
    assert m["rollout_correction_zero_token_fraction"] == pytest.approx(2 / 9)


def test_apply_without_engine_logprobs():
    old, _, mask = fixed_inputs()
    b = batch_with(old, torch.full_like(old, float("nan")))
    assert rc.apply(RolloutCorrectionConfig(), b, None) == {}            # mode none: weights 1, no metrics
    assert torch.equal(b[rc.WEIGHTS], mask)
    with pytest.raises(RuntimeError, match=r"token_truncate.*log-probs"):
        rc.apply(RolloutCorrectionConfig(mode="token_truncate"), b, None)


# -- configuration ---------------------------------------------------------------------------------
def test_a_bad_mode_is_refused_with_the_allowed_modes(tmp_path):
    from slurm_align.config import load_run_config
    from slurm_align.config.errors import ConfigError

    cfg = tmp_path / "run.yaml"
    cfg.write_text("algorithm: grpo\nrl: {n_samples_per_prompt: 2}\nreward: {rule: slurm_align.rewards.sort:exact}\n"
                   "rollout_correction: {mode: tis}\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(cfg)
    msg = str(e.value)
    assert "run.yaml" in msg and "rollout_correction.mode" in msg and "tis" in msg
    assert all(m in msg for m in MODES)
    with pytest.raises(ConfigError, match="threshold"):
        load_run_config(cfg, ["rollout_correction.mode=token_mask", "rollout_correction.threshold=0.5"])
    with pytest.raises(ConfigError, match="temperature"):
        load_run_config(cfg, ["rollout_correction.mode=token_mask", "generation.engine=trtllm",
                              "generation.temperature=0.8"])
    assert load_run_config(cfg, ["rollout_correction.mode=sequence_mask"]).rollout_correction.threshold == 2.0


# -- a real run --------------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.slow
def test_grpo_run_with_token_truncate_logs_the_correction_and_stores_the_engine_logprobs(tmp_path):
    """2 steps of the tiny GRPO example on the local profile (2 actor ranks, DP=2: the metrics are
    all-reduced), sampling at temperature 0.8: the engine and the trainer score the same policy,
    so the correction is ~1 and the KL ~0, and the store keeps the engine's log-probs. (From a
    random init the responses rarely end, so the policy barely moves: a learning run is not
    what this checks.)"""
    import json

    import numpy as np

    from slurm_align import REPO_ROOT
    from slurm_align.config import load_profile, load_run_config
    from slurm_align.slurm.launch import launch_run
    from slurm_align.store.rollouts import RolloutStore

    synth = REPO_ROOT / "examples" / "synthetic"
    run = load_run_config(REPO_ROOT / "examples" / "grpo_tiny.yaml", [
        f"data.train_path={synth / 'prompts.jsonl'}", "eval.interval=0", "ppo.num_steps=2",
        "ppo.num_rollout_samples=8", "rl.n_samples_per_prompt=4", "ppo.global_batch_size=32",
        "ppo.train_micro_batch_size=8", "generation.max_new_tokens=8", "generation.prompt_batch_size=2",
        "generation.temperature=0.8", "rollout_correction.mode=token_truncate"])
    job = launch_run(run, load_profile("local"), tmp_path / "run")
    state = job.wait(timeout_s=900)
    if state != "COMPLETED":
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for ps in job.failed_logs().values() for p in ps)
        pytest.fail(f"run ended {state}\n{logs}")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        get = lambda k, r=r: r[f"train_rollouts/rollout_correction_{k}"]  # noqa: E731
        kl = get("kl_k3")
        assert math.isfinite(kl) and 0.0 <= kl < 1e-4, kl
        assert abs(get("weight_mean") - 1.0) < 1e-2 and 0.99 < get("weight_max") <= 2.0
        assert get("zero_token_fraction") == 0.0 and get("zero_sequence_fraction") == 0.0   # truncation never zeroes
    store = RolloutStore.open(tmp_path / "run" / "rollouts.zarr", read_only=True)
    assert store.steps.tolist() == [1, 2]
    d = store.read()
    assert len(d["rollout_logprobs"]) == len(d["logprobs"]) > 0
    assert np.isfinite(d["rollout_logprobs"]).all() and (d["rollout_logprobs"] <= 0).all()
    assert np.abs(d["rollout_logprobs"] - d["logprobs"]).max() < 1e-3
