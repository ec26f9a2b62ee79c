"""SteerLM's data steps: label SFT rows with a regression reward model's predicted attributes,
and condition SFT prompts on attribute values.

The one attribute format (what the conditioned SFT trains on and generation is steered with):
the prompt followed by `<attributes>name:value,name:value,...</attributes>`, each value the
attribute rounded to an integer (half to even) and clamped to HelpSteer2's 0-4 scale, in the reward model's
attribute order, e.g. `3142=<attributes>correctness:4,verbosity:2</attributes>`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from slurm_align.losses.regression import AttributeDataset
from slurm_align.models.forward import last_token_values, per_sequence
from slurm_align.models.worker import ModelWorker
from slurm_align.rundir import write_atomic

OPEN, CLOSE = "<attributes>", "</attributes>"
SCALE = (0, 4)
"""HelpSteer2's label range: conditioned values are clamped into it."""


def render_attributes(names: Sequence[str], values: Sequence[float]) -> str:
    """`<attributes>a:v,...</attributes>` with each value rounded and clamped to SCALE."""
    lo, hi = SCALE
    return OPEN + ",".join(f"{n}:{min(hi, max(lo, round(float(v))))}" for n, v in zip(names, values)) + CLOSE


def condition(prompt: str, names: Sequence[str], values: Sequence[float]) -> str:
    """The prompt as the attribute-conditioned model sees it."""
    return prompt + render_attributes(names, values)


def prompt_suffix(attributes: Mapping[str, float]) -> str:
    """What generation conditioned on `attributes` (eval.attributes) appends to every prompt;
    nothing for none."""
    return render_attributes(list(attributes), list(attributes.values())) if attributes else ""


@torch.no_grad()
def predict_attributes(worker: ModelWorker, ds: AttributeDataset) -> torch.Tensor:
    """The regression reward model's attributes [rows, attributes] at each row's last token,
    in the data set's row order (last pipeline stage; empty elsewhere)."""
    def scores(output, mb):
        values = per_sequence(output, mb)
        return {"pred": last_token_values(values if values.dim() == 3 else values.unsqueeze(-1), mb["lengths"])}

    out = worker.forward(ds, list(range(len(ds))), scores)
    if not out:
        return torch.empty(0)
    return out["pred"][out["index"].argsort()]


def write_labelled(ds: AttributeDataset, names: Sequence[str], predictions: torch.Tensor, path: Path) -> Path:
    """The SteerLM SFT data set: each plain SFT row with its predicted attributes (raw floats,
    under their names) and its input conditioned on them (rounded, clamped)."""
    lines = []
    for row, pred in zip(ds.sft.rows, predictions.tolist()):
        if row.is_chat:
            raise ValueError(f"line {row.line}: SteerLM labelling takes plain {{input, output}} rows")
        lines.append(json.dumps({**row.extra, "input": condition(row.data["input"], names, pred),
                                 "output": row.data["output"], **dict(zip(names, pred))}))
    write_atomic(path, "".join(line + "\n" for line in lines))   # a reader never sees part of it
    return path
