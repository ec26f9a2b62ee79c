"""Regression reward model (HelpSteer2-style): one value-head output per attribute, trained
with the mean squared error against each row's labels at the sequence's last token.

Rows are SFT rows ({"input", "output"} or chat rows) carrying a number per attribute, e.g.
{"input": "3142=", "output": "1234", "helpfulness": 4, "correctness": 4, ..., "verbosity": 2};
an attribute a row leaves out (or sets to null) is unlabelled there and adds nothing to the loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from slurm_align.config.errors import ConfigError
from slurm_align.data.datasets import SFTDataset
from slurm_align.losses.base import Loss
from slurm_align.losses.registry import RegressionOptions
from slurm_align.models.forward import last_token_values, per_sequence


class AttributeDataset:
    """SFT rows with their attribute labels: batch() adds "labels" [n, attributes] (NaN where a
    row has no label)."""

    def __init__(self, path: str | Path, tok, max_len: int, attributes: list[str], *, require_labels: bool = True,
                 columns: Mapping[str, str] | None = None):
        self.sft = SFTDataset(path, tok, max_len, columns)
        self.pad_id = self.sft.pad_id
        labels, problems = [], []
        for row in self.sft.rows:
            values = {**row.extra, **row.data}
            out = []
            for a in attributes:
                v = values.get(a)
                if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                    problems.append(f"line {row.line}: attribute {a!r} must be a number or null, got {v!r}")
                out.append(float("nan") if v is None or not isinstance(v, int | float) else float(v))
            labels.append(out)
        if problems:
            raise ConfigError(problems[:20], path)
        self.labels = torch.tensor(labels, dtype=torch.float32).reshape(len(labels), len(attributes))
        if require_labels and not torch.isfinite(self.labels).any():   # (labelling rows needs none)
            raise ConfigError([f"no row labels any of the attributes {attributes} (loss 'regression')"], path)

    def __len__(self) -> int:
        return len(self.sft)

    def item_tokens(self, indices: list[int]) -> np.ndarray:
        return self.sft.item_tokens(indices)

    def batch(self, indices: list[int]) -> dict:
        return {**self.sft.batch(indices), "labels": self.labels[indices]}


class Regression(Loss):
    name = "regression"
    value_head = True
    columns = ("tokens", "lengths", "mask", "real", "labels")

    options: RegressionOptions

    def __init__(self, options, model):
        super().__init__(options, model)
        self.value_outputs = len(options.attributes)

    def dataset(self, path, tok, max_len: int, columns: Mapping[str, str] | None = None):
        return AttributeDataset(path, tok, max_len, self.options.attributes, columns=columns)

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
