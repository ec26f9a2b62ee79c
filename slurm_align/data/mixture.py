"""Several data sets mixed with weights (data.mixture), for every data kind (prompts, SFT,
preferences, KTO, attribute rows): one data set whose position j is row r of source s, drawn
once from the run's seed.

    mix = Mixture(sizes=[1000, 50], weights=[0.75, 0.25], seed=7)
    mix.source[j], mix.row[j]        # position j of the mixed set

Each position draws its source with probability weight / sum(weights); the k-th position of
source s takes row perm_s[k mod size_s] (a seeded permutation of the source: a small source
repeats only after all its rows were used). The mapping is a pure function of (sizes, weights,
seed), and a step's prompts (rollout_collector.prompt_order) or batch (datasets.DataOrder) are a
pure function of the step, so a resumed run continues with exactly the samples an uninterrupted
one would draw.

    spec = MixtureSpec([(path_a, 0.75, None), (path_b, 0.25, {"input": "q"})], seed=7)
    SFTDataset(spec, tok, max_len)      # any data set takes a spec where it takes a path

Each source's rows are read when first used (LazyRows), so a rank reads only its share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from slurm_align.data.datasets import PromptDataset
from slurm_align.data.jsonl import LazyRows, Row
from slurm_align.data.sources import open_source

T = TypeVar("T")

MIX_KEY = 0x6D6978
"""Seeds the mixture's generator apart from the run's other uses of its seed."""


class Mixture:
    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int, length: int | None = None):
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"a mixture needs one weight per source: {len(sizes)} sources, {len(weights)} weights")
        if min(sizes) < 1 or min(weights) <= 0:
            raise ValueError(f"every source needs rows and a positive weight (sizes {list(sizes)}, "
                             f"weights {list(weights)})")
        n = int(length if length is not None else sum(sizes))
        p = np.asarray(weights, dtype=np.float64)
        rng = np.random.default_rng([seed, MIX_KEY])
        self.source = rng.choice(len(sizes), size=n, p=p / p.sum())
        self.row = np.empty(n, dtype=np.int64)
        for s, size in enumerate(sizes):
            at = np.flatnonzero(self.source == s)
            perm = np.random.default_rng([seed, MIX_KEY, s]).permutation(size)
            self.row[at] = perm[np.arange(len(at)) % size]

    def __len__(self) -> int:
        return len(self.source)


class MixedRows(Sequence[T]):
    """Rows of several sources at a Mixture's positions: position j is row mix.row[j] of source
    mix.source[j] (parts: any sequences, LazyRows for the text data sets, read when first used)."""

    def __init__(self, mix: Mixture, parts: Sequence[Sequence[T]]):
        self.mixture, self.parts = mix, parts

    def __len__(self) -> int:
        return len(self.mixture)

    def __getitem__(self, j):  # type: ignore[override]  # int -> row, slice -> list
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        return self.parts[int(self.mixture.source[j])][int(self.mixture.row[j])]


@dataclass(frozen=True)
class MixtureSpec:
    """data.mixture as the data sets take it in place of a path: (path, weight, column map or
    None for the run's data.columns) per source, the run's seed, the positions (None: the
    sources' rows together)."""

    sources: list[tuple[Path, float, Mapping[str, str] | None]]
    seed: int
    length: int | None = None

    @property
    def path(self) -> str:
        return "data.mixture (" + ", ".join(str(p) for p, _, _ in self.sources) + ")"

    def over(self, parts: Sequence[Sequence[T]]) -> MixedRows[T]:
        """The mixed set over one part per source (in `sources` order), whatever a part holds."""
        return MixedRows(Mixture([len(p) for p in parts], [w for _, w, _ in self.sources], self.seed, self.length),
                         parts)

    def mixed_rows(self, kind: str, columns: Mapping[str, str] | None) -> MixedRows[Row]:
        return self.over([LazyRows(open_source(p, kind, cols if cols else columns), kind)
                          for p, _, cols in self.sources])


def mixture_spec(run) -> MixtureSpec:
    """The run's data.mixture as a MixtureSpec."""
    return MixtureSpec([(s.path, s.weight, s.columns) for s in run.data.mixture], run.seed, run.data.mixture_size)


def training_data(run) -> Path | MixtureSpec:
    """What the run trains on: data.train_path, or data.mixture as a MixtureSpec."""
    if run.data.mixture:
        return mixture_spec(run)
    assert run.data.train_path is not None, "checked at submit (slurm.launch) and by the trainer"
    return run.data.train_path


def run_prompts(run, tokenizer) -> PromptDataset:
    """The run's training prompts (data.train_path or data.mixture), the column maps applied;
    a prompt must leave generation.max_new_tokens of model.max_seq_len."""
    return PromptDataset(training_data(run), tokenizer, run.model.max_seq_len, run.data.columns,
                         reserve=run.generation.max_new_tokens)
