"""Several prompt sets mixed with weights (data.mixture): one data set whose position j is row
r of source s, drawn once from the run's seed.

    mix = Mixture(sizes=[1000, 50], weights=[0.75, 0.25], seed=7)
    mix.source[j], mix.row[j]        # position j of the mixed set

Each position draws its source with probability weight / sum(weights); the k-th position of
source s takes row perm_s[k mod size_s] (a seeded permutation of the source: a small source
repeats only after all its rows were used). The mapping is a pure function of (sizes, weights,
seed), and a step's prompts are a pure function of the step (rollout_collector.prompt_order), so
a resumed run continues with exactly the samples an uninterrupted one would draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from slurm_align.data.datasets import PromptDataset

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


class _MixedItems(Sequence):
    def __init__(self, mix: Mixture, parts: list[Sequence[Any]]):
        self._mix, self._parts = mix, parts

    def __len__(self) -> int:
        return len(self._mix)

    def __getitem__(self, j):  # type: ignore[override]  # int -> item, slice -> list
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        return self._parts[int(self._mix.source[j])][int(self._mix.row[j])]


class MixedPrompts:
    """PromptDatasets (data/datasets.py) mixed as one: token_arrays() and fields() over the
    mixture's positions, each prompt encoded when first used in its own source."""

    def __init__(self, datasets: list[PromptDataset], weights: Sequence[float], seed: int, length: int | None = None):
        self.datasets = datasets
        self.mixture = Mixture([len(d) for d in datasets], weights, seed, length)

    def __len__(self) -> int:
        return len(self.mixture)

    def token_arrays(self) -> Sequence[np.ndarray]:
        return _MixedItems(self.mixture, [d.token_arrays() for d in self.datasets])

    def fields(self) -> list[dict]:
        per_source = [d.fields() for d in self.datasets]
        return [per_source[s][r] for s, r in zip(self.mixture.source.tolist(), self.mixture.row.tolist())]


def run_prompts(run, tokenizer) -> PromptDataset | MixedPrompts:
    """The run's training prompts: data.train_path (a PromptDataset) or data.mixture (MixedPrompts),
    with the column maps applied; either has token_arrays() and fields()."""
    max_len = run.model.max_seq_len
    if run.data.mixture:
        parts = [PromptDataset(s.path, tokenizer, max_len, s.columns or run.data.columns) for s in run.data.mixture]
        return MixedPrompts(parts, [s.weight for s in run.data.mixture], run.seed, run.data.mixture_size)
    assert run.data.train_path is not None, "checked at submit (slurm.launch)"
    return PromptDataset(run.data.train_path, tokenizer, max_len, run.data.columns)
