"""Open a run directory for analysis, with clear errors for what is not one or is incomplete."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console

from slurm_align.config import load_run_config
from slurm_align.config.errors import ConfigError
from slurm_align.rundir import RunDir
from slurm_align.store.traces import TraceTable, drop_incomplete_steps, read_traces


class NotARunDirError(ConfigError):
    """The path is not a run directory (no config.yaml / traces.zarr)."""


class IncompleteStoreError(ConfigError):
    """Ranks or steps are missing from the trace store; `--allow-incomplete` goes on with the rest."""


@dataclass
class RunTraces:
    run_dir: Path
    table: TraceTable
    spans: np.ndarray
    """The spans analysed: all of them, or (allow_incomplete) the steps every found rank has."""
    config: object | None = None
    """The run's RunConfig, when config.yaml loads."""

    @property
    def name(self) -> str:
        return self.run_dir.name


def expected_ranks(config) -> dict[str, int]:
    return {comp: config.parallel(comp).world_size for comp in config.components}


def load_run(path: str | Path, *, allow_incomplete: bool = False, console: Console | None = None) -> RunTraces:
    rd = RunDir(Path(path))
    if not rd.root.is_dir():
        raise NotARunDirError(["no such directory (expected a run directory holding config.yaml "
                               "and traces.zarr)"], rd.root)
    if not rd.is_run_dir() and not rd.traces.is_dir():
        raise NotARunDirError(["not a run directory: it has neither config.yaml nor traces.zarr "
                               "(give the folder `slurm-align submit` printed, e.g. runs/run-...)"], rd.root)
    if not (rd.traces / "zarr.json").is_file():
        raise NotARunDirError(["this run recorded no spans: traces.zarr is missing (did any rank "
                               "start? see logs/)"], rd.root)
    config = None
    if rd.is_run_dir():
        try:
            config = load_run_config(rd.config)
        except ConfigError as e:
            if console:
                console.print(f"[yellow]warning:[/] config.yaml does not load ({e}); rank counts "
                              "are taken from the store", highlight=False)
    table = read_traces(rd.traces, expected_ranks(config) if config else None)
    if not len(table.spans):
        raise IncompleteStoreError(["traces.zarr holds no committed spans"], rd.traces)
    spans = table.spans
    if not table.complete:
        if not allow_incomplete:
            raise IncompleteStoreError(
                [*table.problems(), "pass --allow-incomplete to analyse the ranks and steps that are there"],
                rd.traces)
        spans = drop_incomplete_steps(table)
        if console:
            for p in table.problems():
                console.print(f"[yellow]incomplete:[/] {rd.root.name}: {p} (going on without it)",
                              highlight=False)
    return RunTraces(rd.root, table, spans, config)
