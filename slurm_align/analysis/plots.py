"""PNG charts: per-component phase bars (per step or per run), a swimlane timeline of one step, and
the scaling curve against ideal."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # files only; no display on login or compute nodes
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from slurm_align.profiling.phases import IDLE, PHASES, phase_order

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


def _mean_component(b: Breakdown, comp: str, phases: list[str]) -> np.ndarray:
    """[phases] mean seconds per step of one component, in the given phase order."""
    values = b.component_phase_s.get(comp)
    if values is None or not len(values):
        return np.zeros(len(phases))
    mean = values.mean(axis=0)
    return np.array([mean[b.phases.index(p)] if p in b.phases else 0.0 for p in phases])


_HATCHES = ("", "////", "....", "xxxx")


def _component_bars(ax, labels: list[str], phases: list[str], per_comp: dict[str, np.ndarray],
                    totals: np.ndarray) -> None:
    """One stacked bar per component per label, side by side (the first component plain, the next
    hatched): each stacks its own component's phases (concurrent components overlap in time, so
    their phases are never stacked together); the black line across a group is the step time."""
    colors = phase_colors(phases)
    comps = list(per_comp)
    width = 0.8 / len(comps)
    x = np.arange(len(labels))
    drawn: set[str] = set()
    for k, comp in enumerate(comps):
        pos = x - 0.4 + width * (k + 0.5)
        bottom = np.zeros(len(labels))
        values = per_comp[comp]
        for j, phase in enumerate(phases):
            if phase == IDLE or not np.any(values[:, j]):
                continue
            ax.bar(pos, values[:, j], bottom=bottom, width=width * 0.92, color=colors[phase],
                   hatch=_HATCHES[k % len(_HATCHES)], edgecolor="white", linewidth=0.3,
                   label=None if phase in drawn else phase)
            drawn.add(phase)
            bottom += values[:, j]
    ax.hlines(totals, x - 0.45, x + 0.45, colors="black", linewidth=1.5, label="step time", zorder=3)
    step = max(1, len(labels) // 25)   # at most ~25 tick labels
    ax.set_xticks(x[::step], [labels[i] for i in range(0, len(labels), step)])
    ax.set_ylabel("seconds (max over a component's ranks)")
    handles, names = ax.get_legend_handles_labels()
    order = [names.index(p) for p in phases if p in names] + [names.index("step time")]
    handles, names = [handles[i] for i in order], [names[i] for i in order]
    for k, comp in enumerate(comps):   # which bar is which component
        handles.append(Patch(facecolor="white", edgecolor="0.35", hatch=_HATCHES[k % len(_HATCHES)]))
        names.append(f"{comp} bar")
    ax.legend(handles, names, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_breakdown(breakdowns: Sequence[Breakdown], out: Path, per: str = "auto") -> Path:
    """Per step (one run) or per run (several: the ablation view): a bar for each component."""
    if per == "auto":
        per = "step" if len(breakdowns) == 1 else "run"
    phases = phase_order({p for b in breakdowns for p in b.phases})
    comps = sorted({c for b in breakdowns for c in b.component_phase_s})

    def column(b: Breakdown, comp: str) -> np.ndarray:   # [steps, phases] in the common order
        values = b.component_phase_s.get(comp, np.zeros((len(b.steps), len(b.phases))))
        return np.stack([values[:, b.phases.index(p)] if p in b.phases else np.zeros(len(b.steps))
                         for p in phases], axis=1)

    if per == "step":
        b = breakdowns[0]
        per_comp = {c: column(b, c) for c in comps}
        labels, totals, title = [str(s) for s in b.steps], b.step_s, f"{b.name}: time per step"
    else:
        per_comp = {c: np.stack([_mean_component(b, c, phases) for b in breakdowns]) for c in comps}
        labels = [b.name for b in breakdowns]
        totals = np.array([b.mean_step_s for b in breakdowns])
        title = "mean step time per run"
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 0.45 * len(labels) * len(comps) + 3)), 4.2))
    _component_bars(ax, labels, phases, per_comp, totals)
    ax.set_title(title)
    ax.set_xlabel("step" if per == "step" else "run")
    return _save(fig, out)


def plot_timeline(spans: np.ndarray, step: int, out: Path, title: str = "") -> Path:
    """Swimlanes of one step: a lane per component and rank, each span a box coloured by phase,
    seconds from the step's first span. Overlap between the actor and the critic shows at a glance."""
    sel = spans[spans["step"] == step]
    if not len(sel):
        raise ValueError(f"step {step} has no spans")
    t0 = sel["start_ns"].min()
    lanes = sorted({(str(c), int(r)) for c, r in zip(sel["component"], sel["rank"])})
    phases = phase_order(np.unique(sel["phase"]).tolist())
    colors = phase_colors(phases)
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(lanes) + 1.6))
    for y, (comp, rank) in enumerate(lanes):
        mine = sel[(sel["component"] == comp) & (sel["rank"] == rank)]
        # Longer spans first, so a span nested in another is drawn on top of it.
        for sp in mine[np.argsort(-(mine["end_ns"] - mine["start_ns"]), kind="stable")]:
            a, b = (sp["start_ns"] - t0) / 1e9, (sp["end_ns"] - t0) / 1e9
            nested = np.any((mine["start_ns"] <= sp["start_ns"]) & (mine["end_ns"] >= sp["end_ns"])
                            & ((mine["end_ns"] - mine["start_ns"]) > (sp["end_ns"] - sp["start_ns"])))
            h = 0.5 if nested else 0.8
            ax.broken_barh([(a, b - a)], (y - h / 2, h), facecolors=colors[str(sp["phase"])],
                           edgecolors="black", linewidth=0.4)
    ax.set_yticks(range(len(lanes)), [f"{c} {r}" for c, r in lanes])
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds since the step's first span (step {step})")
    ax.set_xlim(0, (sel["end_ns"].max() - t0) / 1e9 * 1.01)
    ax.grid(axis="x", color="0.9")
    ax.set_axisbelow(True)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in phases]
    ax.legend(handles, phases, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or f"step {step}: spans per component and rank")
    return _save(fig, out)


def _save(fig, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def plot_scaling(report: ScalingReport, out: Path) -> Path:
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
        bds = [p.breakdown for p in pts if p.breakdown is not None]   # every point's (pts)
        phases = phase_order({ph for b in bds for ph in b.phases})
        comps = sorted({c for b in bds for c in b.component_phase_s})
        per_comp = {c: np.array([_mean_component(b, c, phases) for b in bds]) for c in comps}
        _component_bars(right, [f"{p.nodes} node(s)" for p in pts], phases, per_comp,
                        np.array([p.step_s for p in pts]))
    left.set_xlabel("actor nodes")
    left.set_ylabel("samples / s")
    left.set_title(f"{report.mode} scaling")
    left.legend(fontsize=8)
    right.set_title("mean step time by component and phase")
    return _save(fig, out)
