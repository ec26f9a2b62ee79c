"""Sweep planning (pure) and a real sweep of 1 and 2 actor nodes on the local Slurm cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import ConfigError, RunConfig, load_profile, load_run_config
from slurm_align.slurm.render import Entry
from slurm_align.slurm.sweep import critic_nodes_for, parse_nodes, plan_sweep, start_sweep
from slurm_align.store.rollouts import RolloutStore
from slurm_align.store.traces import read_traces
from tests.integration.test_ppo import check_complete_run

EXAMPLE = REPO_ROOT / "examples" / "ppo_tiny.yaml"


def test_parse_nodes_and_ratio():
    assert parse_nodes("4,1,2") == [1, 2, 4]
    for bad in ("", "0,1", "a,b", "2,2"):
        with pytest.raises(ConfigError, match="--nodes"):
            parse_nodes(bad)
    assert [critic_nodes_for(n, "2:1") for n in (1, 2, 3, 4, 8)] == [1, 1, 2, 2, 4]
    assert [critic_nodes_for(n, "1:1") for n in (1, 4)] == [1, 4]


def test_plan_weak_and_strong():
    run = RunConfig(actor={"tensor_parallel": 2}, ppo={"num_rollout_samples": 16},
                    sweep={"actor_to_critic_nodes": "2:1"})
    profile = load_profile("local-slurm").model_copy(deep=True)
    profile.components["actor"].tasks_per_node = 4
    weak = plan_sweep(run, profile, [1, 2, 4], "weak")
    assert [(p.nodes, p.critic_nodes) for p in weak] == [(1, 1), (2, 1), (4, 2)]
    assert [p.run.actor.data_parallel for p in weak] == [2, 4, 8]   # 4 ranks/node over TP 2
    assert [p.run.critic.data_parallel for p in weak] == [1, 1, 2]
    assert [p.run.ppo.num_rollout_samples for p in weak] == [16, 32, 64]
    assert [p.profile.components["actor"].nodes for p in weak] == [1, 2, 4]
    assert [p.profile.components["critic"].nodes for p in weak] == [1, 1, 2]
    strong = plan_sweep(run, profile, [1, 2, 4], "strong")
    assert [p.run.ppo.num_rollout_samples for p in strong] == [16, 16, 16]
    assert profile.components["actor"].nodes == 2  # the input profile is untouched
    sft = plan_sweep(RunConfig(algorithm="sft", trainer={"global_batch_size": 8}), profile, [2, 4], "weak")
    assert [p.run.trainer.global_batch_size for p in sft] == [8, 16] and sft[0].critic_nodes == 0


def test_plan_scales_what_grpo_reads_and_reports_every_component():
    """A GRPO run with a reward model: weak scaling grows the prompts per step and the PPO-style
    global batch it trains on (never trainer.global_batch_size, which GRPO does not read), and the
    reward-only critic component gets (and reports) its nodes."""
    run = RunConfig(algorithm="grpo", rl={"n_samples_per_prompt": 4}, reward={"model": True},
                    ppo={"num_rollout_samples": 4, "global_batch_size": 8}, trainer={"global_batch_size": 16},
                    sweep={"actor_to_critic_nodes": "2:1"})
    assert run.components == ("actor", "critic")
    profile = load_profile("local-slurm")
    weak = plan_sweep(run, profile, [1, 2, 4], "weak")
    assert [p.run.ppo.num_rollout_samples for p in weak] == [4, 8, 16]
    assert [p.run.ppo.global_batch_size for p in weak] == [8, 16, 32]
    assert [p.run.trainer.global_batch_size for p in weak] == [16, 16, 16]   # untouched
    assert [p.batch for p in weak] == [4, 8, 16]
    assert [p.critic_nodes for p in weak] == [1, 1, 2]
    assert [p.component_nodes for p in weak] == [{"actor": 1, "critic": 1}, {"actor": 2, "critic": 1},
                                                 {"actor": 4, "critic": 2}]
    rule_only = plan_sweep(RunConfig(algorithm="grpo", rl={"n_samples_per_prompt": 2},
                                     reward={"rule": "slurm_align.rewards.sort:exact"}), profile, [1, 2], "weak")
    assert [p.component_nodes for p in rule_only] == [{"actor": 1}, {"actor": 2}]


def test_plan_errors_name_the_problem():
    profile = load_profile("local-slurm")  # 1 task per node
    with pytest.raises(ConfigError, match=r"actor\.tensor_parallel x pipeline_parallel"):
        plan_sweep(RunConfig(actor={"tensor_parallel": 2}), profile, [1, 2], "weak")
    with pytest.raises(ConfigError, match="multiples of the smallest"):
        plan_sweep(RunConfig(ppo={"num_rollout_samples": 3}), profile, [2, 3], "weak")
    with pytest.raises(ConfigError, match="--mode"):
        plan_sweep(RunConfig(), profile, [1], "sideways")
    with pytest.raises(Exception, match="actor_to_critic_nodes"):
        RunConfig(sweep={"actor_to_critic_nodes": "2-1"})


@pytest.mark.slurm
def test_real_sweep_on_slurm_then_scaling_report(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        # Real PPO runs, one point at a time (2 cores); each critic binds port 0 and publishes it.
        [sys.executable, "-m", "slurm_align.cli", "sweep", str(EXAMPLE), "ppo.num_steps=3",
         "ppo.num_rollout_samples=4", "generation.max_new_tokens=8", "generation.prompt_batch_size=2",
         "ppo.train_micro_batch_size=2", "--profile", "local-slurm",
         "--nodes", "1,2", "--mode", "weak", "--sweep-dir", str(sweep), "--max-concurrent", "1", "--poll-s", "0.5"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = json.loads((sweep / "sweep.json").read_text())
    assert [(p["nodes"], p["critic_nodes"], p["rollout_samples"], p["state"]) for p in manifest["points"]] == [
        (1, 1, 4, "COMPLETED"), (2, 1, 8, "COMPLETED")]
    assert [p["component_nodes"] for p in manifest["points"]] == [{"actor": 1, "critic": 1}, {"actor": 2, "critic": 1}]
    assert all(p["job_id"].isdigit() for p in manifest["points"])  # real Slurm jobs
    for nodes, samples in ((1, 4), (2, 8)):
        run_dir = sweep / f"nodes{nodes}"
        table = read_traces(run_dir / "traces.zarr", {"actor": nodes, "critic": 1})
        assert table.complete, table.problems()
        assert table.ranks == {"actor": list(range(nodes)), "critic": [0]}
        assert sorted(set(table.spans["step"].tolist())) == [1, 2, 3]
        store = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True)
        assert store.steps.tolist() == [1, 2, 3] and store.num_samples == 3 * samples
    # The 2-node point is a whole PPO hetjob run (every step, sample, span and metric).
    check_complete_run(sweep / "nodes2", steps=3, samples=8, actor_ranks=2)
    out = subprocess.run([sys.executable, "-m", "slurm_align.cli", "analyze", "scaling", str(sweep),
                          "--format", "json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    p1, p2 = report["points"]
    assert p1["efficiency"] == pytest.approx(1.0)
    # Timings vary with machine load, so check the report's arithmetic, not the speed:
    # weak efficiency T1/T2, samples/s from the rollout store's 4 and 8 samples per step.
    assert p2["efficiency"] == pytest.approx(p1["step_s"] / p2["step_s"])
    assert p1["samples_per_s"] == pytest.approx(4 / p1["step_s"])
    assert p2["samples_per_s"] == pytest.approx(8 / p2["step_s"])
    assert p1["tokens_per_s"] > 0 and set(p1["phase_s"]) >= {"generate", "train", "critic_train", "idle"}
    img = matplotlib.image.imread(sweep / "scaling.png")
    assert img.shape[0] > 100 and len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 10
    table = subprocess.run([sys.executable, "-m", "slurm_align.cli", "analyze", "scaling", str(sweep), "--no-plot"],
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and "samples/s" in table.stdout


@pytest.mark.slurm
def test_sweep_records_a_failing_point_and_refuses_one_that_cannot_start(slurm_cluster, tmp_path):
    # 3 actor nodes + 2 critic nodes on a 4-node cluster could never start: refused, nothing submitted.
    never = tmp_path / "never"
    proc = subprocess.run([sys.executable, "-m", "slurm_align.cli", "sweep", str(EXAMPLE), "--profile", "local-slurm",
                           "--nodes", "1,3", "--sweep-dir", str(never), "--entry", "report"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "5 nodes in partition 'debug'" in proc.stderr and "it has 4" in proc.stderr
    assert not never.exists()

    # A point whose job fails is recorded with where it failed; the others go on.
    run = load_run_config(EXAMPLE, ["ppo.num_rollout_samples=4"])
    entry = Entry("report", scripts={"actor": Path(__file__).parents[1] / "programs" / "sweep_failing_actor.py"})
    manifest = start_sweep(run, load_profile("local-slurm"), [1, 2], "weak", tmp_path / "sweep", EXAMPLE,
                           entry=entry, max_concurrent=1, poll_s=0.5)
    ok, bad = manifest.points
    assert ok.state == "COMPLETED" and bad.state == "FAILED", manifest.points
    assert "actor rank" in bad.error and "fails on purpose" in bad.error and "logs:" in bad.error
    saved = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [p["state"] for p in saved["points"]] == ["COMPLETED", "FAILED"]



def test_a_2x2_settings_sweep_runs_four_jobs_each_with_its_settings(tmp_path):
    """Four jobs (local profile, the `report` launcher: the jobs themselves, not training, which
    the report's unit test reads from metrics.jsonl), one per point of lr x micro batch, each run
    with its point's config; the report then has a row per point."""
    synth = REPO_ROOT / "examples" / "synthetic"
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "slurm_align.cli", "sweep", str(REPO_ROOT / "examples" / "sft_tiny.yaml"),
         "--profile", "local", "--sweep-dir", str(sweep_dir), "--set", "trainer.lr=1e-3,3e-2",
         "--set", "trainer.micro_batch_size=2,4", "--entry", "report", f"data.train_path={synth / 'sft_train.jsonl'}",
         "--poll-s", "0.5"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    grid = [{"trainer.lr": lr, "trainer.micro_batch_size": mb} for lr in ("1e-3", "3e-2") for mb in ("2", "4")]
    points = json.loads((sweep_dir / "sweep.json").read_text())["points"]
    assert [(p["settings"], p["state"]) for p in points] == [(g, "COMPLETED") for g in grid]
    for p, g in zip(points, grid):
        run = load_run_config(sweep_dir / p["run_dir"] / "config.yaml")
        assert (run.trainer.lr, run.trainer.micro_batch_size) == (float(g["trainer.lr"]),
                                                                 int(g["trainer.micro_batch_size"]))
        assert len(list((sweep_dir / p["run_dir"] / "reports" / "actor").glob("rank*.json"))) == 2   # it ran
    report = subprocess.run([sys.executable, "-m", "slurm_align.cli", "analyze", "settings", str(sweep_dir),
                             "--metric", "loss", "--no-plot"], capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert len((sweep_dir / "settings.csv").read_text().splitlines()) == 5
