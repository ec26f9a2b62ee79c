"""Where a checkpoint folder's steps are and which are complete, without torch or megatron: what
the preemption path reads on a signal thread (slurm_align.slurm.preemption) and where
the rest of models/checkpoint.py takes it from."""

from __future__ import annotations

import re
from pathlib import Path

MANIFEST = "manifest.json"
"""Written last into iter_<step>/: the checkpoint is complete once it exists."""
ITER_NAME = re.compile(r"^iter_(\d+)$")


def iter_dir(root: Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def find_latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (folders without a manifest are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [(int(m.group(1)), p) for p in root.iterdir()
            if (m := ITER_NAME.match(p.name)) and (p / MANIFEST).is_file()]
    return max(done)[1] if done else None
