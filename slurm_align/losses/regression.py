"""Regression reward model (HelpSteer2-style): one value-head output per attribute, trained
with the mean squared error against each row's labels at the sequence's last token.

Rows are SFT rows ({"input", "output"} or chat rows) carrying a number per attribute, e.g.
{"input": "3142=", "output": "1234", "helpfulness": 4, "correctness": 4, ..., "verbosity": 2};
an attribute a row leaves out (or sets to null) is unlabelled there and adds nothing to the loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slurm_align.config.errors import ConfigError
from slurm_align.data.datasets import SFTDataset
from slurm_align.losses.base import Loss
from slurm_align.losses.registry import RegressionOptions
from slurm_align.models.forward import last_token_values, per_sequence

LABEL_CHECK = 2000
"""Rows whose labels the data set checks when it opens (at least one must be labelled)."""


class AttributeDataset:
    """SFT rows with their attribute labels: batch() adds "labels" [n, attributes] (NaN where a
    row has no label)."""

    def __init__(self, path: Any, tok, max_len: int, attributes: list[str], *, require_labels: bool = True,
                 columns: Mapping[str, str] | None = None, truncate: bool = False):
        self.sft = SFTDataset(path, tok, max_len, columns, truncate)
        self.pad_id, self.attributes = self.sft.pad_id, list(attributes)
        self.path = Path(getattr(path, "path", path))
        # Labels are read with their rows; whether any row is labelled is checked on the first
        # LABEL_CHECK rows (the rest are read by the ranks that use them).
        first = self.labels_of(range(min(len(self.sft), LABEL_CHECK)))
        if require_labels and not torch.isfinite(first).any():   # (labelling rows needs none)
            raise ConfigError([f"no row of the first {len(first)} labels any of the attributes {attributes} "
                               "(loss 'regression')"], self.path)

    def labels_of(self, indices) -> torch.Tensor:
        """[n, attributes] float32: the rows' labels, NaN where a row has none."""
        out = []
        for i in indices:
            row = self.sft.rows[i]
            values = {**row.extra, **row.data}
            labels = []
            for a in self.attributes:
                v = values.get(a)
                if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                    raise ConfigError([f"{row.where}: attribute {a!r} must be a number or null, got {v!r}"],
                                      row.path or self.path)
                labels.append(float("nan") if v is None else float(v))
            out.append(labels)
        return torch.tensor(out, dtype=torch.float32).reshape(len(out), len(self.attributes))

    @property
    def labels(self) -> torch.Tensor:
        """Every row's labels (reads the whole data set: labelling, not training, uses it)."""
        return self.labels_of(range(len(self.sft)))

    def __len__(self) -> int:
        return len(self.sft)

    def item_tokens(self, indices: list[int]) -> np.ndarray:
        return self.sft.item_tokens(indices)

    def batch(self, indices: list[int]) -> dict:
        return {**self.sft.batch(indices), "labels": self.labels_of(indices)}


class Regression(Loss):
    name = "regression"
    value_head = True
    columns = ("tokens", "lengths", "mask", "real", "labels")

    options: RegressionOptions

    def __init__(self, options, model):
        super().__init__(options, model)
        self.value_outputs = len(options.attributes)

    def dataset(self, path, tok, max_len: int, columns: Mapping[str, str] | None = None, truncate: bool = False):
        return AttributeDataset(path, tok, max_len, self.options.attributes, columns=columns, truncate=truncate)

    def count(self, mb):
        """Labelled (row, attribute) entries: the MSE is their mean."""
        return float((torch.isfinite(mb["labels"]) * mb["real"][:, None]).sum())

    def __call__(self, output, mb):
        values = per_sequence(output, mb)
        if values.dim() == 2:   # a one-attribute head returns [b, s]
            values = values.unsqueeze(-1)
        pred = last_token_values(values, mb["lengths"])                      # [b, attributes]
        labels = mb["labels"].to(pred.device)
        labelled = torch.isfinite(labels) & (mb["real"].to(pred.device)[:, None] > 0)
        err = torch.where(labelled, pred - torch.nan_to_num(labels), torch.zeros_like(pred))
        sq = err ** 2
        loss_sum = sq.sum()
        sums = {"loss_sum": loss_sum.detach(), "labelled": labelled.sum().float()}
        for i, a in enumerate(self.options.attributes):
            sums[f"sq_{a}"] = sq[:, i].detach().sum()
            sums[f"n_{a}"] = labelled[:, i].sum().float()
        return loss_sum / mb["norm"], sums

    def metrics(self, s):
        out = {"loss": float(s["loss_sum"] / s["labelled"].clamp(min=1))}
        for a in self.options.attributes:
            out[f"mse_{a}"] = float(s[f"sq_{a}"] / s[f"n_{a}"].clamp(min=1))
        return out
