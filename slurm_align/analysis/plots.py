"""PNG charts: stacked per-phase bars (per step or per run) and the scaling curve against ideal."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; no display on login or compute nodes
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from slurm_align.profiling.phases import IDLE, PHASES, phase_order  # noqa: E402

if TYPE_CHECKING:
    from slurm_align.analysis.breakdown import Breakdown
    from slurm_align.analysis.scaling import ScalingReport


def phase_colors(names: Sequence[str]) -> dict[str, tuple]:
    """A fixed colour per known phase (same in every chart), others after, idle grey."""
    cmap = plt.get_cmap("tab20")
    colors = {p: cmap(i % 20) for i, p in enumerate(PHASES)}
    extra = [n for n in names if n not in colors and n != IDLE]
    for i, n in enumerate(extra):
        colors[n] = cmap((len(PHASES) + i) % 20)
    colors[IDLE] = (0.8, 0.8, 0.8, 1.0)
    return colors


def _stacked(ax, labels: list[str], phases: list[str], values: np.ndarray, totals: np.ndarray) -> None:
    colors = phase_colors(phases)
    x = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    for j, phase in enumerate(phases):
        if not np.any(values[:, j]):
            continue
        ax.bar(x, values[:, j], bottom=bottom, color=colors[phase], label=phase, width=0.7)
        bottom += values[:, j]
    ax.scatter(x, totals, marker="_", s=600, color="black", zorder=3, label="step time")
    ax.set_xticks(x, labels, rotation=30 if len(labels) > 8 else 0, ha="right" if len(labels) > 8 else "center")
    ax.set_ylabel("seconds (max over ranks)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_breakdown(breakdowns: Sequence["Breakdown"], out: Path, per: str = "auto") -> Path:
    """One bar per step (a single run) or one bar per run (several: the ablation view)."""
    if per == "auto":
        per = "step" if len(breakdowns) == 1 else "run"
    phases = phase_order({p for b in breakdowns for p in b.phases})
    if per == "step":
        b = breakdowns[0]
        values = np.stack([b.phase_s[:, b.phases.index(p)] for p in phases], axis=1)
        labels, totals, title = [str(s) for s in b.steps], b.step_s, f"{b.name}: time per step"
    else:
        values = np.array([[b.mean_phase_s[b.phases.index(p)] if p in b.phases else 0.0 for p in phases]
                           for b in breakdowns])
        labels = [b.name for b in breakdowns]
        totals = np.array([b.mean_step_s for b in breakdowns])
        title = "mean step time per run"
    fig, ax = plt.subplots(figsize=(max(5.0, 0.5 * len(labels) + 4), 4))
    _stacked(ax, labels, phases, values, totals)
    ax.set_title(title)
    ax.set_xlabel("step" if per == "step" else "run")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_scaling(report: "ScalingReport", out: Path) -> Path:
    """Left: samples/s against ideal linear scaling; right: per-phase split of each point."""
    pts = [p for p in report.points if p.breakdown is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if pts:
        nodes = np.array([p.nodes for p in pts], dtype=float)
        thr = np.array([p.samples_per_s for p in pts])
        ideal = thr[0] * nodes / nodes[0]
        left.plot(nodes, thr, "o-", label="measured")
        left.plot(nodes, ideal, "k--", label="ideal")
        for n, t, e in zip(nodes, thr, [p.efficiency for p in pts]):
            left.annotate(f"{100 * e:.0f}%", (n, t), textcoords="offset points", xytext=(4, -12), fontsize=8)
        left.set_xscale("log", base=2)
        left.set_xticks(nodes, [str(int(n)) for n in nodes])
        phases = phase_order({ph for p in pts for ph in p.breakdown.phases})
        values = np.array([[p.breakdown.mean_phase_s[p.breakdown.phases.index(ph)]
                            if ph in p.breakdown.phases else 0.0 for ph in phases] for p in pts])
        _stacked(right, [f"{p.nodes} node(s)" for p in pts], phases, values,
                 np.array([p.step_s for p in pts]))
    left.set_xlabel("actor nodes")
    left.set_ylabel("samples / s")
    left.set_title(f"{report.mode} scaling")
    left.legend(fontsize=8)
    right.set_title("mean step time split by phase")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
