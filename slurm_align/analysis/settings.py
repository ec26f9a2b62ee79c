"""The report of a sweep over settings (`slurm-align sweep --set ...`): chosen metrics of every
point's metrics.jsonl side by side, as a table, settings.csv and a chart.

A metric is a key of metrics.jsonl: `val/score` gives its value at the last step that has it (the
end of the run), `timers/step:mean` its mean over the steps that have it (step time).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from slurm_align.config.errors import ConfigError
from slurm_align.slurm.sweep import Manifest


@dataclass
class SettingsRow:
    point: str
    settings: dict[str, str]
    state: str
    values: dict[str, float]      # metric -> value (nan: the point has none)


def metric_value(records: list[dict], metric: str) -> float:
    """`name`: the value at the last step that has it; `name:mean`: the mean over the steps."""
    name, _, how = metric.partition(":")
    if how not in ("", "mean"):
        raise ConfigError.at("--metric", metric, "NAME (its last value) or NAME:mean (its mean over the steps)")
    values = [float(r[name]) for r in records if isinstance(r.get(name), (int, float))]
    if not values:
        return math.nan
    return sum(values) / len(values) if how == "mean" else values[-1]


def _records(run_dir: Path) -> list[dict]:
    """metrics.jsonl, one record per step (a step logged again after a resume: the last)."""
    by_step: dict[int, dict] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        rec = json.loads(line)
        by_step[int(rec["step"])] = {**by_step.get(int(rec["step"]), {}), **rec}
    return [by_step[s] for s in sorted(by_step)]


def settings_report(sweep_dir: Path, metrics: list[str]) -> list[SettingsRow]:
    manifest = Manifest.load(Path(sweep_dir))
    rows = []
    for p in manifest.points:
        records = _records(manifest.run_path(p))
        rows.append(SettingsRow(p.run_dir, dict(p.settings), p.state, {m: metric_value(records, m) for m in metrics}))
    return rows


def write_csv(rows: list[SettingsRow], metrics: list[str], path: Path) -> None:
    keys = sorted({k for r in rows for k in r.settings})
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["point", *keys, "state", *metrics])
        for r in rows:
            w.writerow([r.point, *(r.settings.get(k, "") for k in keys), r.state, *(r.values[m] for m in metrics)])


def plot_settings(rows: list[SettingsRow], metrics: list[str], path: Path) -> None:
    """One bar chart per metric, a bar per point labelled by its settings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["\n".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in r.settings.items()) or r.point for r in rows]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(4.0, 1.2 * len(rows)), 2.8 * len(metrics)), squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics):
        ax.bar(range(len(rows)), [r.values[metric] for r in rows])
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(metric)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
