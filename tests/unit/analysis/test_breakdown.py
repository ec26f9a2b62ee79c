"""Breakdown, efficiencies, Chrome trace and charts against hand-computed numbers."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import yaml
from rich.console import Console

from slurm_align.analysis.breakdown import compute_breakdown
from slurm_align.analysis.commands import _breakdown_table, _per_step_tables
from slurm_align.analysis.scaling import compute_scaling, efficiencies
from slurm_align.analysis.trace_export import chrome_trace
from slurm_align.cli import main
from slurm_align.config import RunConfig
from slurm_align.profiling.timers import Tracer
from slurm_align.slurm.sweep import Manifest, ManifestPoint
from slurm_align.store.rollouts import TOKEN_FIELDS, RolloutStore
from slurm_align.store.traces import read_traces

MS = 1_000_000
# (component, rank, step, phase, start ms, end ms): the numbers worked by hand below.
SPANS = [
    ("actor", 0, 0, "generate", 0, 40), ("actor", 0, 0, "logprobs", 40, 50), ("actor", 0, 0, "train", 60, 100),
    ("actor", 1, 0, "generate", 0, 30), ("actor", 1, 0, "generate", 35, 55), ("actor", 1, 0, "train", 60, 90),
    ("critic", 0, 0, "critic_infer", 10, 30), ("critic", 0, 0, "critic_train", 60, 80),
    ("actor", 0, 1, "generate", 1000, 1060), ("actor", 0, 1, "train", 1060, 1100),
    ("actor", 1, 1, "generate", 1000, 1050), ("actor", 1, 1, "logprobs", 1010, 1020),  # nested
    ("actor", 1, 1, "train", 1050, 1120),
    ("critic", 0, 1, "critic_infer", 1010, 1020),
]


def write_run(run_dir: Path, spans=SPANS, offset_ms: int = 0, config: RunConfig | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = config or RunConfig(actor={"data_parallel": 2}, critic={"data_parallel": 1})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    keys = sorted({(c, r) for c, r, *_ in spans})
    for comp, rank in keys:
        with Tracer(run_dir, comp, rank) as t:
            for c, r, step, phase, a, b in spans:
                if (c, r) == (comp, rank):
                    t.record(phase, step, (a + offset_ms) * MS, (b + offset_ms) * MS)
    return run_dir


def test_breakdown_equals_hand_computed(tmp_path):
    b = compute_breakdown(read_traces(write_run(tmp_path / "run") / "traces.zarr").spans)
    assert b.steps.tolist() == [0, 1]
    assert b.phases == ["generate", "logprobs", "train", "critic_infer", "critic_train", "idle"]
    # Step time: max over ranks of each rank's own window: step 0 actor0 100 ms, step 1 actor1 120 ms.
    np.testing.assert_allclose(b.step_s, [0.100, 0.120])
    # Phase time: max over ranks of summed spans (actor1's two generate spans add to 50 ms).
    # Idle: step time minus the union of a rank's spans, max over ranks (the critic).
    expected = {"generate": [50, 60], "logprobs": [10, 10], "train": [40, 70], "critic_infer": [20, 10],
                "critic_train": [20, 0], "idle": [60, 110]}
    for j, p in enumerate(b.phases):
        np.testing.assert_allclose(b.phase_s[:, j], np.array(expected[p]) / 1e3, err_msg=p)
    assert b.mean_step_s == pytest.approx(0.110)
    assert dict(zip(b.phases, b.share)) == pytest.approx(
        {"generate": 0.5, "logprobs": 10 / 110, "train": 0.5, "critic_infer": 15 / 110,
         "critic_train": 10 / 110, "idle": 85 / 110})
    expected_idle = {"actor/rank0": [0.010, 0.020], "actor/rank1": [0.020, 0.0], "critic/rank0": [0.060, 0.110]}
    assert sorted(b.idle_s) == sorted(expected_idle)
    for k, v in expected_idle.items():
        np.testing.assert_allclose(b.idle_s[k], v, atol=1e-12, err_msg=k)
    skipped = compute_breakdown(read_traces(tmp_path / "run" / "traces.zarr").spans, skip_steps=1)
    assert skipped.steps.tolist() == [1] and skipped.mean_step_s == pytest.approx(0.120)


def test_efficiencies_hand_computed():
    assert efficiencies([1, 2, 4], [10.0, 12.5, 20.0], "weak") == pytest.approx([1.0, 0.8, 0.5])
    assert efficiencies([1, 2, 4], [10.0, 6.25, 5.0], "strong") == pytest.approx([1.0, 0.8, 0.5])
    assert efficiencies([2, 4], [10.0, 5.0], "strong") == pytest.approx([1.0, 1.0])


def test_chrome_trace_valid(tmp_path):
    spans = read_traces(write_run(tmp_path / "run") / "traces.zarr").spans
    trace = json.loads(json.dumps(chrome_trace(spans)))
    events = trace["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == len(SPANS)
    for e in events:
        assert {"ph", "name", "pid", "tid", "ts"} <= set(e)
    for e in xs:
        assert e["dur"] >= 0 and "cat" in e and "step" in e["args"]
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(1, "actor"), (2, "critic")}
    threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert threads == {(1, 0), (1, 1), (2, 0)}
    # ts/dur in microseconds: actor1's step-1 train span 1050..1120 ms.
    train = [e for e in xs if e["name"] == "train" and e["pid"] == 1 and e["tid"] == 1 and e["args"]["step"] == 1]
    assert train[0]["ts"] == pytest.approx(1_050_000) and train[0]["dur"] == pytest.approx(70_000)


def err_text(capsys) -> str:
    """stderr with rich's line wrapping undone."""
    return " ".join(capsys.readouterr().err.split())


def assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 5_000
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100
    assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 10  # more than a blank canvas


def test_cli_breakdown_json_csv_png_and_compare(tmp_path, capsys):
    a = write_run(tmp_path / "a")
    slower = [(c, r, s, p, x * 2, y * 2) for c, r, s, p, x, y in SPANS]
    b = write_run(tmp_path / "b", slower)
    assert main(["analyze", "breakdown", str(a), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mean_step_s"] == pytest.approx(0.110)
    assert data["mean_phase_s"]["idle"] == pytest.approx(0.085)
    assert data["mean_component_phase_s"]["critic"] == pytest.approx({"critic_infer": 0.015, "critic_train": 0.010})
    assert_png(a / "reports" / "breakdown.png")
    assert main(["analyze", "breakdown", str(a), "--compare", str(b), "--format", "csv", "--png",
                 str(tmp_path / "cmp.png")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "run,step,phase,seconds,step_seconds" and len(lines) == 1 + 2 * 2 * 6
    assert "b,1,train,0.14,0.24" in lines
    assert_png(tmp_path / "cmp.png")
    assert main(["analyze", "breakdown", str(a), "--compare", str(b), "--no-plot"]) == 0
    assert "2.00x" in capsys.readouterr().out
    assert main(["analyze", "trace", str(a), "-o", str(tmp_path / "t.json")]) == 0
    assert len(json.loads((tmp_path / "t.json").read_text())["traceEvents"]) > len(SPANS)


def test_clear_errors_for_bad_or_incomplete_runs(tmp_path, capsys):
    assert main(["analyze", "breakdown", str(tmp_path / "nope")]) == 2
    assert "no such directory" in err_text(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["analyze", "breakdown", str(tmp_path / "empty")]) == 2
    assert "not a run directory" in err_text(capsys)
    # Config says actor DP=3: rank 2 never wrote; rank 1 lacks step 1.
    cfg = RunConfig(actor={"data_parallel": 3}, critic={"data_parallel": 1})
    spans = [s for s in SPANS if s[:3] != ("actor", 1, 1)]
    run = write_run(tmp_path / "inc", spans, config=cfg)
    assert main(["analyze", "breakdown", str(run), "--no-plot"]) == 2
    err = err_text(capsys)
    assert "no spans from rank(s) 2" in err and "rank 1: missing step(s) 1" in err and "--allow-incomplete" in err
    assert main(["analyze", "breakdown", str(run), "--no-plot", "--allow-incomplete", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in data["steps"]] == [0]  # the step rank 1 lacks is left out


def _write_rollouts(run_dir: Path, steps: int, samples: int, resp_len: int, env_tokens: int = 0) -> None:
    """`env_tokens` of each response are a multi-turn environment's (loss_mask 0), the rest the model's."""
    store = RolloutStore.create(run_dir / "rollouts.zarr")
    mask = [1.0] * (resp_len - env_tokens) + [0.0] * env_tokens
    for s in range(steps):
        store.append_step(s, {"prompt_tokens": [[1, 2]] * samples, "response_tokens": [[3] * resp_len] * samples,
                              **{f: [[0.0] * resp_len] * samples for f in TOKEN_FIELDS}, "loss_mask": [mask] * samples,
                              "reward": [0.0] * samples, "is_end": [True] * samples, "rank": [0] * samples,
                              "version": [s] * samples})


def test_scaling_report_hand_computed(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    # Weak scaling: 1 node 100 ms/step with 8 samples; 2 nodes 125 ms/step with 16 samples.
    one = [("actor", 0, s, "generate", 200 * s, 200 * s + 100) for s in range(2)]
    two = [("actor", r, s, "generate", 200 * s, 200 * s + 125) for s in range(2) for r in range(2)]
    cfg1 = RunConfig(actor={"data_parallel": 1}, algorithm="sft")
    cfg2 = RunConfig(actor={"data_parallel": 2}, algorithm="sft")
    write_run(sweep / "nodes1", one, config=cfg1)
    write_run(sweep / "nodes2", two, config=cfg2)
    _write_rollouts(sweep / "nodes1", 2, 8, 10)
    _write_rollouts(sweep / "nodes2", 2, 16, 10)
    Manifest(sweep, "cfg.yaml", "local", "weak", [
        ManifestPoint(1, 0, 8, "nodes1", "COMPLETED"), ManifestPoint(2, 0, 16, "nodes2", "COMPLETED"),
        ManifestPoint(4, 0, 32, "nodes4", "FAILED", error="FAILED; logs: x")]).save()
    report = compute_scaling(sweep)
    p1, p2, p4 = report.points
    assert p1.step_s == pytest.approx(0.100) and p2.step_s == pytest.approx(0.125)
    assert p1.samples_per_s == pytest.approx(80) and p2.samples_per_s == pytest.approx(128)
    assert p1.tokens_per_s == pytest.approx(800) and p2.tokens_per_s == pytest.approx(1280)
    assert p1.efficiency == pytest.approx(1.0) and p2.efficiency == pytest.approx(0.8)
    assert p4.breakdown is None and p4.state == "FAILED"
    assert main(["analyze", "scaling", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "80%" in out and "FAILED" in out
    assert_png(sweep / "scaling.png")
    assert main(["analyze", "scaling", str(tmp_path)]) == 2
    assert "not a sweep directory" in err_text(capsys)


def test_scaling_counts_the_models_tokens_not_the_environments(tmp_path):
    """Multi-turn rollouts: 4 of each response's 10 tokens came from the environment (tool
    results); the token rate counts the 6 the model generated."""
    sweep = tmp_path / "sweep"
    write_run(sweep / "nodes1", [("actor", 0, s, "generate", 200 * s, 200 * s + 100) for s in range(2)],
              config=RunConfig(actor={"data_parallel": 1}, algorithm="sft"))
    _write_rollouts(sweep / "nodes1", 2, 8, 10, env_tokens=4)
    Manifest(sweep, "cfg.yaml", "local", "weak", [ManifestPoint(1, 0, 8, "nodes1", "COMPLETED")]).save()
    (point,) = compute_scaling(sweep).points
    assert point.samples_per_s == pytest.approx(80) and point.tokens_per_s == pytest.approx(8 * 6 / 0.100)


def test_component_phase_times_hand_computed(tmp_path):
    b = compute_breakdown(read_traces(write_run(tmp_path / "run") / "traces.zarr").spans)
    assert sorted(b.component_phase_s) == ["actor", "critic"]
    actor = dict(zip(b.phases, b.component_phase_s["actor"][0]))
    critic = dict(zip(b.phases, b.component_phase_s["critic"][0]))
    assert actor["generate"] == pytest.approx(0.050) and actor["train"] == pytest.approx(0.040)
    assert actor["critic_infer"] == 0 and critic["generate"] == 0
    assert critic["critic_infer"] == pytest.approx(0.020) and critic["critic_train"] == pytest.approx(0.020)
    np.testing.assert_allclose(b.percentile_phase_s(50)[b.phases.index("train")], 0.055)


def test_summary_fits_100_columns_and_per_step_on_request(tmp_path, capsys):
    # 20 steps: the per-step table that used to be the default would be far wider than 100 columns.
    spans = [(c, r, s, p, 1000 * s + a, 1000 * s + e) for s in range(20) for c, r, _, p, a, e in SPANS[:8]]
    run = write_run(tmp_path / "run", spans)
    b = compute_breakdown(read_traces(run / "traces.zarr").spans)
    console = Console(width=100, record=True)
    console.print(_breakdown_table(b))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 100
    for phase in b.phases:
        assert f" {phase} " in text   # whole names, never "gener…"
    assert "p50 s" in text and "max s" in text and "step 3" not in text
    assert main(["analyze", "breakdown", str(run), "--no-plot", "--per-step"]) == 0
    out = capsys.readouterr().out
    assert all(f"step {s} " in out for s in range(20))   # tables as wide as the console, all steps
    tables = _per_step_tables(b, 100)
    assert len(tables) > 1 and sum(len(t.columns) - 1 for t in tables) == 20
    console = Console(width=100, record=True)
    for t in tables:
        console.print(t)
    assert max(len(line) for line in console.export_text().splitlines()) <= 100


def test_bars_per_component_and_timeline_png(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert main(["analyze", "breakdown", str(run), "--timeline-step", "0"]) == 0
    assert_png(run / "reports" / "breakdown.png")
    assert_png(run / "reports" / "timeline_step0.png")
    assert "timeline:" in err_text(capsys)
    assert main(["analyze", "breakdown", str(run), "--timeline-step", "7"]) == 2
    err = err_text(capsys)
    assert "--timeline-step" in err and "not an analysed step" in err
