"""Sweeps over settings (slurm/sweep.py --set) and their report (analysis/settings.py); a real
2x2 sweep of jobs: tests/integration/test_sweep.py."""

from __future__ import annotations

import csv
import json
import math

import pytest

from slurm_align import REPO_ROOT
from slurm_align.analysis.settings import plot_settings, settings_report, write_csv
from slurm_align.config import load_profile, load_run_config
from slurm_align.config.errors import ConfigError
from slurm_align.slurm.sweep import Manifest, ManifestPoint, parse_set, plan_sweep, settings_grid

EXAMPLE = REPO_ROOT / "examples" / "ppo_tiny.yaml"


def test_parse_set_and_the_grid():
    assert parse_set("ppo.actor_lr=1e-6,5e-6") == ("ppo.actor_lr", ["1e-6", "5e-6"])
    for bad in ("ppo.actor_lr", "=1,2", "ppo..lr=1", "ppo.actor_lr=1,,2", "ppo.actor_lr=1,1"):
        with pytest.raises(ConfigError, match="'--set'"):
            parse_set(bad)
    grid = settings_grid([("a.x", ["1", "2"]), ("b.y", ["3", "4"])])
    assert grid == [{"a.x": "1", "b.y": "3"}, {"a.x": "1", "b.y": "4"}, {"a.x": "2", "b.y": "3"},
                    {"a.x": "2", "b.y": "4"}]
    with pytest.raises(ConfigError, match="each field once"):
        settings_grid([("a.x", ["1"]), ("a.x", ["2"])])


def test_each_point_carries_its_settings_at_each_node_count():
    run, profile = load_run_config(EXAMPLE), load_profile("local-slurm")
    sets = [("ppo.actor_lr", ["1e-6", "5e-6"]), ("ppo.kl_coef", ["0.01", "0.1"])]
    points = plan_sweep(run, profile, None, "strong", sets)
    assert [(p.run.ppo.actor_lr, p.run.ppo.kl_coef) for p in points] == [(1e-6, 0.01), (1e-6, 0.1), (5e-6, 0.01),
                                                                         (5e-6, 0.1)]
    assert [p.name for p in points][:2] == ["nodes2-actor_lr1e-6-kl_coef0.01", "nodes2-actor_lr1e-6-kl_coef0.1"]
    assert all(p.profile == profile for p in points)   # without --nodes: the profile as it is
    crossed = plan_sweep(run, profile, [1, 2], "strong", sets[:1])
    assert [(p.nodes, p.run.ppo.actor_lr) for p in crossed] == [(1, 1e-6), (2, 1e-6), (1, 5e-6), (2, 5e-6)]
    assert len({p.name for p in crossed}) == 4


def test_a_bad_value_names_the_set_and_the_field():
    with pytest.raises(ConfigError) as err:
        plan_sweep(load_run_config(EXAMPLE), load_profile("local-slurm"), None, "strong",
                   [("ppo.actor_lr", ["1e-6", "fast"])])
    assert "--set ppo.actor_lr=fast" in str(err.value) and "ppo.actor_lr" in str(err.value)


def test_the_report_reads_each_points_metrics(tmp_path):
    manifest = Manifest(tmp_path, "cfg.yaml", "local", "strong", [
        ManifestPoint(1, 0, 8, "a", state="COMPLETED", settings={"ppo.actor_lr": "1e-6"}),
        ManifestPoint(1, 0, 8, "b", state="FAILED", settings={"ppo.actor_lr": "5e-6"})])
    manifest.save()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "val/score": 0.2}, {"step": 1, "timers/step": 2.0}, {"step": 2, "timers/step": 4.0},
        {"step": 2, "val/score": 0.5}]))   # a step's record twice (a resume): merged, the last wins
    metrics = ["val/score", "timers/step:mean"]
    rows = settings_report(tmp_path, metrics)
    assert [(r.point, r.settings, r.state) for r in rows] == [("a", {"ppo.actor_lr": "1e-6"}, "COMPLETED"),
                                                              ("b", {"ppo.actor_lr": "5e-6"}, "FAILED")]
    assert rows[0].values == {"val/score": 0.5, "timers/step:mean": 3.0}
    assert all(math.isnan(v) for v in rows[1].values.values())   # no metrics.jsonl: nan
    write_csv(rows, metrics, tmp_path / "settings.csv")
    table = list(csv.reader((tmp_path / "settings.csv").read_text().splitlines()))
    assert table[0] == ["point", "ppo.actor_lr", "state", *metrics]
    assert table[1] == ["a", "1e-6", "COMPLETED", "0.5", "3.0"]
    plot_settings(rows, metrics, tmp_path / "settings.png")
    assert (tmp_path / "settings.png").stat().st_size > 1000
    with pytest.raises(ConfigError, match="NAME:mean"):
        settings_report(tmp_path, ["val/score:max"])
