"""Calibration recovers the efficiencies a synthetic trace was generated with, and reads the
response-length distribution from the rollouts."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import yaml

from slurm_align.config import RunConfig
from slurm_align.config.profile import ClusterProfile
from slurm_align.planning.calibration import calibrate, fit
from slurm_align.planning.steptime import Costs, Workload, engine_batches, ideal_phases, phase_times, predict
from slurm_align.profiling.timers import Tracer
from slurm_align.store.rollouts import TOKEN_FIELDS, RolloutStore

TRUE = {"generate": 0.02, "refit": 0.3, "rebalance": 0.05, "logprobs": 0.04, "init_logprobs": 0.03,
        "train": 0.06, "critic_infer": 0.07, "critic_train": 0.08}
"""Efficiencies the synthetic run 'ran' at (far from the defaults, and different per phase)."""
ACTOR_ORDER = ("refit", "generate", "rebalance", "logprobs", "init_logprobs", "store", "train")
PROMPTS, RESPONSES = (5, 7, 6, 9), (3, 12, 8, 30)


def synthetic_run(run_dir: Path, run: RunConfig, profile: ClusterProfile, steps: int = 3) -> dict[str, float]:
    """Traces (actor rank 0 and critic rank 0, phases back to back, in ns) and rollouts of a run
    whose phases take exactly the model's time at TRUE; returns those times."""
    work = Workload(run.rollouts_per_step, PROMPTS, RESPONSES)
    times = phase_times(ideal_phases(run, profile, work), Costs(efficiency=dict(TRUE), constant_s={"store": 0.01}))
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(run.model_dump(mode="json")))
    (run_dir / "profile.yaml").write_text(yaml.safe_dump(profile.model_dump(mode="json")))
    ns = lambda s: round(s * 1e9)  # noqa: E731
    with Tracer(run_dir, "actor", 0) as actor, Tracer(run_dir, "critic", 0) as critic:
        t = 0
        for step in range(1, steps + 1):
            for phase in ACTOR_ORDER:
                actor.record(phase, step, t, t + ns(times[phase]))
                if phase == "generate":
                    critic.record("critic_infer", step, t, t + ns(times["critic_infer"]))
                if phase == "store":
                    critic.record("critic_train", step, t, t + ns(times["critic_train"]))
                t += ns(times[phase])
            t += ns(1.0)
    store = RolloutStore.create(run_dir / "rollouts.zarr")
    n = run.rollouts_per_step
    for step in range(1, steps + 1):
        p = [PROMPTS[i % 4] for i in range(n)]
        r = [RESPONSES[i % 4] for i in range(n)]
        store.append_step(step, {"prompt_tokens": [[1] * k for k in p], "response_tokens": [[3] * k for k in r],
                                 **{f: [[0.0] * k for k in r] for f in TOKEN_FIELDS},
                                 "reward": [0.0] * n, "is_end": [True] * n, "rank": [0] * n, "version": [step] * n})
    store.close()
    return times


RUN = RunConfig(ppo={"num_rollout_samples": 8}, generation={"max_new_tokens": 32, "prompt_batch_size": 2})
PROFILE = ClusterProfile(kind="local")


def test_calibration_recovers_the_efficiencies_the_trace_was_made_with(tmp_path):
    times = synthetic_run(tmp_path / "run", RUN, PROFILE)
    cal = calibrate(tmp_path / "run", skip_steps=1)
    assert cal.steps == [2, 3]
    for phase, eff in TRUE.items():
        assert cal.costs.efficiency[phase] == pytest.approx(eff, rel=1e-6), phase
    assert cal.costs.constant_s["store"] == pytest.approx(0.01, rel=1e-6)
    # the response lengths are the rollouts', so the run's own prediction is its phases
    assert sorted(set(cal.workload.response_lengths)) == sorted(RESPONSES)
    own = cal.predict()
    for phase in TRUE:
        assert own.phases[phase] == pytest.approx(times[phase], rel=1e-5), phase


def test_the_fit_leaves_the_modelled_collectives_out_of_the_efficiencies():
    # TP 2 and DP 2: every pass all-reduces, train reduces its gradients; the fit takes each
    # phase's collectives off its measured time before it divides
    run = RUN.model_copy(update={"actor": RUN.actor.model_copy(update={"tensor_parallel": 2, "data_parallel": 2}),
                                 "critic": RUN.critic.model_copy(update={"tensor_parallel": 2})})
    profile = PROFILE.model_copy(update={"components": {
        **PROFILE.components, "actor": PROFILE.components["actor"].model_copy(update={"tasks_per_node": 4}),
        "critic": PROFILE.components["critic"].model_copy(update={"tasks_per_node": 2})}})
    work = Workload(run.rollouts_per_step, PROMPTS, RESPONSES)
    ideal = ideal_phases(run, profile, work)
    assert all(ideal[f"{p}.link"] > 0 for p in ("generate", "logprobs", "train", "critic_infer", "critic_train"))
    measured = phase_times(ideal, Costs(efficiency=dict(TRUE)))
    costs = fit(run, profile, measured, work)
    for phase, eff in TRUE.items():
        assert costs.efficiency[phase] == pytest.approx(eff, rel=1e-6), phase


def test_a_calibrated_prediction_moves_with_the_layout(tmp_path):
    synthetic_run(tmp_path / "run", RUN, PROFILE)
    cal = calibrate(tmp_path / "run", skip_steps=1)
    wider = RUN.model_copy(update={"actor": RUN.actor.model_copy(update={"data_parallel": 2})})
    profile = PROFILE.model_copy(update={"components": {**PROFILE.components, "actor": PROFILE.components["actor"]
                                                        .model_copy(update={"tasks_per_node": 2})}})
    two = cal.predict(wider, profile)
    # DP 2 on a host of os.cpu_count() cores: each rank's share of the passes is half the work
    one = cal.predict()
    assert two.phases["logprobs"] < one.phases["logprobs"]
    assert len(engine_batches(RUN, cal.workload)) == 4


def test_predict_uses_the_response_length_distribution():
    short = predict(RUN, PROFILE, work=Workload(8, (5,), (4,)))
    long = predict(RUN, PROFILE, work=Workload(8, (5,), (4, 4, 4, 30)))
    assert long.phases["generate"] > short.phases["generate"]


def test_scaling_report_shows_the_calibrated_prediction_beside_the_measurement(tmp_path, capsys):
    from slurm_align.analysis.scaling import compute_scaling
    from slurm_align.cli import main
    from slurm_align.planning.calibration import predict_scaling
    from slurm_align.slurm.sweep import Manifest, ManifestPoint

    synthetic_run(tmp_path / "calibration", RUN, PROFILE)
    cal = calibrate(tmp_path / "calibration")
    sweep = tmp_path / "sweep"
    wide_run = RUN.model_copy(update={"actor": RUN.actor.model_copy(update={"data_parallel": 2}),
                                      "ppo": RUN.ppo.model_copy(update={"num_rollout_samples": 16})})
    wide_profile = PROFILE.model_copy(update={"components": {**PROFILE.components, "actor": PROFILE.components[
        "actor"].model_copy(update={"tasks_per_node": 2})}})
    synthetic_run(sweep / "nodes1", RUN, PROFILE)
    synthetic_run(sweep / "nodes2", wide_run, wide_profile)
    Manifest(sweep, "cfg.yaml", "local", "weak", [ManifestPoint(1, 1, 8, "nodes1", "COMPLETED"),
                                                  ManifestPoint(2, 1, 16, "nodes2", "COMPLETED")]).save()
    report = compute_scaling(sweep, skip_steps=1)
    predict_scaling(report, cal)
    p1, p2 = report.points
    assert p1.predicted_step_s == pytest.approx(cal.predict().step_s)
    assert p2.predicted_step_s == pytest.approx(cal.predict(wide_run, wide_profile).step_s)
    assert p2.predicted_phase_s == pytest.approx(cal.predict(wide_run, wide_profile).phases)
    assert main(["analyze", "scaling", str(sweep), "--calibration", str(tmp_path / "calibration"), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "predicted s" in out and f"{p2.predicted_step_s:.3f}" in out


def test_sweep_predict_only_prints_the_points_and_submits_nothing(tmp_path, capsys):
    from slurm_align.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text("algorithm: ppo\ndata: {train_path: x.jsonl}\n")
    sweep = tmp_path / "sweep"
    assert main(["sweep", str(cfg), "--profile", "local-slurm", "--nodes", "1,2,4", "--predict", "--predict-only",
                 "--sweep-dir", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "predicted step time" in out and "4 actor node(s)" in out and "actor 4n" in out
    assert not sweep.exists()


def test_the_constants_of_a_shared_host_run_move_with_the_jobs_cores(tmp_path, monkeypatch):
    # the local test cluster on a 1-core host: the actor's rank and the critic's (2 cores asked)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    shared = ClusterProfile(kind="local", hardware={"accelerator": "cpu", "shared_host": True})
    synthetic_run(tmp_path / "run", RUN, shared)
    cal = calibrate(tmp_path / "run", skip_steps=1)
    assert cal.costs.constant_share == pytest.approx(1 / 2)
    assert cal.predict().phases["store"] == pytest.approx(0.01, rel=1e-6)   # its own share
    # 4 actor ranks and the critic: the same per-step work at 1 / 5 of a core instead of 1 / 2
    four = shared.model_copy(update={"components": {**shared.components, "actor": shared.components["actor"]
                                                    .model_copy(update={"nodes": 4})}})
    bigger = cal.predict(RUN.model_copy(update={"actor": RUN.actor.model_copy(update={"data_parallel": 4})}), four)
    assert bigger.phases["store"] == pytest.approx(0.01 * 5 / 2, rel=1e-6)


def _actor(run: RunConfig, profile: ClusterProfile, dp: int) -> tuple[RunConfig, ClusterProfile]:
    """`run` and `profile` with `dp` actor ranks (one node)."""
    return (run.model_copy(update={"actor": run.actor.model_copy(update={"data_parallel": dp})}),
            profile.model_copy(update={"components": {**profile.components, "actor": profile.components["actor"]
                                                      .model_copy(update={"tasks_per_node": dp})}}))


def test_a_calibration_at_one_data_parallel_rank_says_so_for_layouts_with_more(tmp_path, capsys):
    # bench_plan.py measured it: a 1-rank calibration under-predicts the 4-rank training pass by
    # 26-53%, the ranks' waits for each other being in no span of it; a 2-rank one by -19..+13%.
    one_run, one_profile = _actor(RUN, PROFILE, 1)
    synthetic_run(tmp_path / "one", one_run, one_profile)
    cal = calibrate(tmp_path / "one", skip_steps=1)
    assert cal.notes([one_run]) == []
    four = _actor(RUN, PROFILE, 4)[0]
    (note,) = cal.notes([one_run, four])
    assert "actor.data_parallel=1, a predicted layout actor.data_parallel=4" in note, note
    assert "train is likely under-predicted" in note, note
    # the critic (data_parallel 1 in both) has nothing to say; a calibration at 2 ranks neither
    assert dataclasses.replace(cal, run=_actor(RUN, PROFILE, 2)[0]).notes([four]) == []
    # `plan` prints it under the table, for the points of a sweep
    from slurm_align.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(one_run.model_dump(mode="json", exclude={"algorithm_spec"}, exclude_defaults=True)))
    assert main(["plan", str(cfg), "--profile", "local", "--nodes", "1,2", "--calibration", str(tmp_path / "one")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^note: the calibration run has actor.data_parallel=1, a predicted layout "
                     r"actor.data_parallel=\d", out, re.M), out
