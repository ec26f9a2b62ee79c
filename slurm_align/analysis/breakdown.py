"""Step-time breakdown from spans, reduced as NeMo-Aligner reduces its timers (max over ranks).

Definitions (per step s; a "rank" is one (component, rank) pair):
  step time T_s   = max over ranks of (last span end - first span start) of that rank in step s.
                    Each rank's window uses only its own clock, so clock offsets between hosts
                    cannot inflate it.
  phase time P_sp = max over ranks of the summed durations of that rank's spans of phase p in s.
  busy_r,s        = length of the union of rank r's spans in s (nested spans are not counted twice).
  idle_r,s        = T_s - busy_r,s; the `idle` phase of a step is the max over ranks of idle_r,s.
  means           = plain means over the steps analysed; share_p = mean P_p / mean T.
  component time  = the phase times above over one component's ranks only (C_c,s,p), so the
                    actor's and the critic's phases can be drawn side by side.
Phase times of ranks that run concurrently (actor and critic) overlap, so the phases of one step
may add up to more than T_s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slurm_align.profiling.phases import IDLE, phase_order


@dataclass
class Breakdown:
    name: str
    steps: np.ndarray
    """Step numbers analysed, ascending."""
    phases: list[str]
    """Phase columns, step order, `idle` last."""
    phase_s: np.ndarray
    """[steps, phases] seconds (max over ranks)."""
    step_s: np.ndarray
    """[steps] step time in seconds."""
    idle_s: dict[str, np.ndarray] = field(default_factory=dict)
    """'component/rankN' -> [steps] idle seconds of that rank."""
    component_phase_s: dict[str, np.ndarray] = field(default_factory=dict)
    """component -> [steps, phases] seconds, max over that component's ranks (no idle column value)."""
    tokens: np.ndarray | None = None
    """[steps] rollout tokens (prompt + response) of each step (analysis/throughput.py), if known."""
    model_flops: np.ndarray | None = None
    """[steps] model FLOPs of each step, from the architecture (analysis/throughput.py)."""
    peak_flops: float | None = None
    """FLOP/s of all the run's ranks together at peak (the profile's), for MFU."""

    @property
    def tokens_per_s(self) -> np.ndarray | None:
        return None if self.tokens is None else self.tokens / self.step_s

    @property
    def mfu(self) -> np.ndarray | None:
        """[steps] model FLOPs utilisation: model FLOPs / (step time x peak FLOP/s)."""
        if self.model_flops is None or not self.peak_flops:
            return None
        return self.model_flops / (self.step_s * self.peak_flops)

    def percentile_phase_s(self, q: float) -> np.ndarray:
        """[phases] the q-th percentile over steps (50: the median)."""
        return np.percentile(self.phase_s, q, axis=0) if len(self.steps) else np.full(len(self.phases), np.nan)

    @property
    def mean_step_s(self) -> float:
        return float(self.step_s.mean()) if len(self.step_s) else float("nan")

    @property
    def mean_phase_s(self) -> np.ndarray:
        return self.phase_s.mean(axis=0) if len(self.steps) else np.full(len(self.phases), np.nan)

    @property
    def share(self) -> np.ndarray:
        return self.mean_phase_s / self.mean_step_s

    def to_dict(self) -> dict:
        out = self._times_dict()
        rates = {"tokens_per_s": self.tokens_per_s, "mfu": self.mfu}
        for key, values in rates.items():
            if values is not None:
                out[f"mean_{key}"] = float(values.mean())
                for row, v in zip(out["steps"], values.tolist()):
                    row[key] = v
        return out

    def _times_dict(self) -> dict:
        return {
            "run": self.name,
            "definition": "step time = max over ranks of (last end - first start); phase = max over "
                          "ranks of summed span time; idle = step time - union of a rank's spans",
            "mean_step_s": self.mean_step_s,
            "mean_phase_s": dict(zip(self.phases, self.mean_phase_s.tolist())),
            "share": dict(zip(self.phases, self.share.tolist())),
            "steps": [
                {"step": int(s), "step_s": float(t), "phase_s": dict(zip(self.phases, row.tolist()))}
                for s, t, row in zip(self.steps, self.step_s, self.phase_s)
            ],
            "idle_per_rank_s": {k: float(v.mean()) for k, v in self.idle_s.items()},
            "mean_component_phase_s": {c: {p: float(v) for p, v in zip(self.phases, values.mean(axis=0)) if v}
                                       for c, values in self.component_phase_s.items()},
        }


def _union_length(starts: np.ndarray, ends: np.ndarray) -> int:
    order = np.argsort(starts, kind="stable")
    total, cur_s, cur_e = 0, None, None
    for s, e in zip(starts[order], ends[order]):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return int(total + (cur_e - cur_s if cur_e is not None else 0))


def compute_breakdown(spans: np.ndarray, name: str = "run", skip_steps: int = 0) -> Breakdown:
    """Breakdown of a span table (SPAN_DTYPE); the first `skip_steps` steps (warm-up) are left out."""
    steps = np.unique(spans["step"])[skip_steps:]
    phases = phase_order([*np.unique(spans["phase"]).tolist(), IDLE])
    col = {p: i for i, p in enumerate(phases)}
    rank_keys = sorted({(str(c), int(r)) for c, r in zip(spans["component"], spans["rank"])})
    phase_s = np.zeros((len(steps), len(phases)))
    step_s = np.zeros(len(steps))
    idle = {f"{c}/rank{r}": np.zeros(len(steps)) for c, r in rank_keys}
    by_comp = {c: np.zeros((len(steps), len(phases))) for c in sorted({c for c, _ in rank_keys})}
    for i, step in enumerate(steps):
        sel = spans[spans["step"] == step]
        per_rank = {}
        for comp, rank in rank_keys:
            mine = sel[(sel["component"] == comp) & (sel["rank"] == rank)]
            if not len(mine):
                continue
            per_rank[(comp, rank)] = mine
            step_s[i] = max(step_s[i], (mine["end_ns"].max() - mine["start_ns"].min()) / 1e9)
            for phase in np.unique(mine["phase"]):
                dur = (mine["end_ns"] - mine["start_ns"])[mine["phase"] == phase].sum() / 1e9
                j = col[str(phase)]
                phase_s[i, j] = max(phase_s[i, j], dur)
                by_comp[comp][i, j] = max(by_comp[comp][i, j], dur)
        for (comp, rank), mine in per_rank.items():
            gap = step_s[i] - _union_length(mine["start_ns"], mine["end_ns"]) / 1e9
            idle[f"{comp}/rank{rank}"][i] = gap
            phase_s[i, col[IDLE]] = max(phase_s[i, col[IDLE]], gap)
    return Breakdown(name, steps, phases, phase_s, step_s, idle, by_comp)
