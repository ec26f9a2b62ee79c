"""Checkpoint retention: keep the newest `keep_last` checkpoints and the best `keep_best` by a
metric of metrics.jsonl; delete the rest. Torch-free (the login node and tests read it).

Rules that keep a run resumable whatever happens while pruning:
- it runs only after a newer checkpoint was committed (its manifest written, folder renamed), so
  the newest complete checkpoint, the one a resume loads, is always kept (keep_last >= 1);
- a folder is first renamed out of the iter_<step> pattern (`.pruning-iter_<step>`, one atomic
  rename), then deleted: a job killed while deleting leaves a folder no reader takes for a
  checkpoint, which the next prune removes;
- folders it does not recognise as complete checkpoints (no manifest; `.tmp` of a save in flight)
  are never touched.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from slurm_align.config.run import CheckpointingConfig
from slurm_align.models.checkpoint_names import ITER_NAME, MANIFEST

PRUNING = ".pruning-"


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under `root` (iter_<step> with a manifest), ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir()
                  if (m := ITER_NAME.match(p.name)) and (p / MANIFEST).is_file())


def read_scores(metrics_path: Path, metric: str) -> dict[int, float]:
    """{step: value of `metric`} from metrics.jsonl (the last record of a step wins: a resumed run
    rewrites the steps after its checkpoint)."""
    scores: dict[int, float] = {}
    try:
        lines = Path(metrics_path).read_text().splitlines()
    except FileNotFoundError:
        return scores
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:   # a line being appended
            continue
        if isinstance(rec.get(metric), (int, float)):
            scores[int(rec["step"])] = float(rec[metric])
    return scores


def steps_to_keep(steps: Iterable[int], keep_last: int, keep_best: int = 0, scores: dict[int, float] | None = None,
                  mode: str = "max") -> set[int]:
    """The newest `keep_last` of `steps` and the best `keep_best` of those with a score (ties: the
    newer); keep_last 0 keeps every step."""
    steps = sorted(steps)
    if keep_last <= 0:
        return set(steps)
    kept = set(steps[-keep_last:])
    scored = [s for s in steps if scores and s in scores]
    sign = 1.0 if mode == "max" else -1.0
    best = sorted(scored, key=lambda s: (sign * scores[s], s), reverse=True)[:keep_best] if scores else []
    return kept | set(best)


def prune(root: Path, keep_last: int, keep_best: int = 0, scores: dict[int, float] | None = None, mode: str = "max",
          companions: Callable[[int], list[Path]] = lambda step: []) -> list[int]:
    """Delete the complete checkpoints under `root` that `steps_to_keep` does not keep, with each
    one's `companions(step)` (files of the same step elsewhere: the critic's). Returns the steps
    deleted. Called on one rank, after a newer checkpoint was committed."""
    root = Path(root)
    for left in root.glob(f"{PRUNING}*") if root.is_dir() else []:   # a prune that was killed
        shutil.rmtree(left, ignore_errors=True)
    steps = complete_steps(root)
    kept = steps_to_keep(steps, keep_last, keep_best, scores, mode)
    gone = [s for s in steps if s not in kept]
    for step in gone:
        folder = next(p for p in root.iterdir() if (m := ITER_NAME.match(p.name)) and int(m.group(1)) == step)
        doomed = folder.with_name(PRUNING + folder.name)
        os.replace(folder, doomed)   # atomic: from here on no reader takes it for a checkpoint
        for extra in companions(step):
            extra.unlink(missing_ok=True)
        shutil.rmtree(doomed)
    return gone


def apply_retention(cfg: CheckpointingConfig, root: Path, metrics_path: Path,
                    companions: Callable[[int], list[Path]] = lambda step: []) -> list[int]:
    """The run's retention (run.checkpointing) on one role's checkpoints; nothing when it keeps all."""
    if not cfg.keep_last:
        return []
    scores = read_scores(metrics_path, cfg.best_metric) if cfg.keep_best and cfg.best_metric else None
    return prune(root, cfg.keep_last, cfg.keep_best, scores, cfg.best_mode, companions)
