"""Load a Hugging Face folder's safetensors into this rank's megatron model chunks.

Each rank reads only the tensors of its pipeline stage and, within them, only the rows or
columns of its tensor-parallel slice (safetensors `get_slice` on a memory map, one file open per
read so the mapping's pages are let go): a rank's peak host memory is about its own shard.
Before reading anything, every rank checks the whole folder (index, every shard present and
complete, every tensor there with the shape the config implies), so all ranks fail alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from slurm_align.config.errors import ConfigError
from slurm_align.config.run import ModelConfig
from slurm_align.models.hf.config import architecture, read_hf_config
from slurm_align.models.hf.mapping import Source, fill_shard, sources, to_hf
from slurm_align.models.weights import EMBEDDING, _tp_partition_dim, local_tensors, tied_copy

INDEX = "model.safetensors.index.json"


class SafetensorsFolder:
    """The tensors of a folder's *.safetensors files (with or without an index): names, shapes,
    and slice reads. Opening checks every shard is there and complete (headers only)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError([f"not a safetensors index ({type(e).__name__}: {e})"], index) from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise ConfigError([f"no *.safetensors files (and no {INDEX}) in {self.folder}"], self.folder)
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            path = self.folder / name
            if not path.is_file():
                raise ConfigError([f"safetensors shard {name} listed in {INDEX} is missing"], path)
            try:
                with safe_open(path, "pt") as f:
                    for key in f.keys():  # noqa: SIM118  (safe_open has keys() but is not iterable)
                        self.where[key] = name
                        self.shapes[key] = tuple(f.get_slice(key).get_shape())
            except (SafetensorError, OSError) as e:
                raise ConfigError([f"unreadable or truncated safetensors file ({e})"], path) from None

    def resolve(self, name: str) -> str | None:
        """`name`, or the same tensor saved without its model prefix (e.g. GPT2Model's `h.0...`)."""
        if name in self.where:
            return name
        bare = name.split(".", 1)[1] if name.startswith(("transformer.", "model.")) else name
        return bare if bare in self.where else None

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        """A copy (in the file's dtype) of tensor `name`, or of its [start:stop) along `dim`."""
        key = self.resolve(name)
        if key is None:   # check_hf_folder found every tensor before any is read
            raise KeyError(name)
        with safe_open(self.folder / self.where[key], "pt") as f:
            sl = f.get_slice(key)
            if dim is None:
                t = sl[:]
            else:
                index = [slice(None)] * len(self.shapes[key])
                index[dim] = slice(start, stop)
                t = sl[tuple(index)]
        return t  # get_slice copies: nothing refers to the mapping after this


def megatron_shapes(cfg: ModelConfig, value_head: bool) -> dict[str, tuple[int, ...]]:
    """Full (TP=1) shape of every megatron tensor of `cfg`, by name."""
    h, hd, v = cfg.hidden_size, cfg.head_dim, cfg.padded_vocab_size
    qkv = (cfg.num_attention_heads + 2 * cfg.query_groups) * hd
    fc1 = cfg.ffn * (2 if cfg.activation == "swiglu" else 1)
    norm = ("weight",) if cfg.normalization == "RMSNorm" else ("weight", "bias")
    out: dict[str, tuple[int, ...]] = {EMBEDDING: (v, h)}
    if cfg.position_embedding == "learned":
        out["embedding.position_embeddings.weight"] = (cfg.max_seq_len, h)
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        out.update({p + f"input_layernorm.{k}": (h,) for k in norm})
        out[p + "self_attention.linear_qkv.weight"] = (qkv, h)
        if cfg.qk_layernorm:
            out.update({p + f"self_attention.{n}_layernorm.{k}": (hd,) for n in "qk" for k in norm})
        if cfg.add_qkv_bias or cfg.add_bias_linear:
            out[p + "self_attention.linear_qkv.bias"] = (qkv,)
        out[p + "self_attention.linear_proj.weight"] = (h, cfg.num_attention_heads * hd)
        out.update({p + f"pre_mlp_layernorm.{k}": (h,) for k in norm})
        if cfg.num_experts is not None:
            out[p + "mlp.router.weight"] = (cfg.num_experts, h)
            for e in range(cfg.num_experts):
                out[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (fc1, h)
                out[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, cfg.ffn)
        else:
            out[p + "mlp.linear_fc1.weight"] = (fc1, h)
            out[p + "mlp.linear_fc2.weight"] = (h, cfg.ffn)
        if cfg.add_bias_linear:
            out[p + "self_attention.linear_proj.bias"] = (h,)
            out[p + "mlp.linear_fc1.bias"] = (fc1,)
            out[p + "mlp.linear_fc2.bias"] = (h,)
    out.update({f"decoder.final_layernorm.{k}": (h,) for k in norm})
    if value_head:
        out.update({"value_head.weight": (cfg.num_labels, h), "value_head.bias": (cfg.num_labels,)})
    elif not cfg.tie_embeddings:
        out["output_layer.weight"] = (v, h)
    return out


def check_folder(files: SafetensorsFolder, srcs: dict[str, Source], cfg: ModelConfig, model_type: str,
                 value_head: bool) -> None:
    """Every HF tensor the model needs is there with the shape its config implies."""
    shapes = megatron_shapes(cfg, value_head)
    problems = []
    for name, src in srcs.items():
        meta = torch.empty(shapes[name], device="meta")
        for hf_name, want in to_hf(src, meta, cfg, model_type).items():
            key = files.resolve(hf_name)
            if key is None:
                problems.append(f"tensor {hf_name} is missing (needed for {name})")
                continue
            got, want_shape = files.shapes[key], tuple(want.shape)
            ok = got == want_shape or (src.kind == "rows" and got[1:] == want_shape[1:] and got[0] >= want_shape[0])
            if not ok:
                problems.append(f"tensor {hf_name} in {files.where[key]} has shape {list(got)}, "
                                f"config.json implies {list(want_shape)}")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ConfigError(problems[:10] + ([more] if more else []), files.folder)


@dataclass
class CheckedFolder:
    """An HF folder that passed check_hf_folder: its files, model type and tensor sources."""

    files: SafetensorsFolder
    model_type: str
    sources: dict[str, Source]


def check_hf_folder(cfg: ModelConfig, folder: str | Path | None = None, *, value_head: bool = False) -> CheckedFolder:
    """Everything about the folder (default cfg.hf_path) that can be wrong, found before any
    weight is read: config.json, architecture, index, shards present and complete, tensors
    there with the shapes the config implies. Raises ConfigError naming the file."""
    folder = folder or cfg.hf_path
    assert folder is not None, "a folder, or a model config with hf_path"
    folder = Path(folder)
    hf = read_hf_config(folder)
    arch, model_type = architecture(hf, folder / "config.json")
    score_head = value_head and arch.endswith("ForSequenceClassification")
    labels = len(hf.get("id2label") or {0: 0})
    if score_head and labels != cfg.num_labels:
        raise ConfigError([f"{arch} has {labels} label(s), model.num_labels={cfg.num_labels} (a scalar reward "
                           "model has 1, a regression reward model one per attribute)"], folder / "config.json")
    srcs = sources(cfg, model_type, value_head=value_head, score_head=score_head)
    files = SafetensorsFolder(folder)
    check_folder(files, srcs, cfg, model_type, value_head)
    return CheckedFolder(files, model_type, srcs)


@torch.no_grad()
def load_hf_weights(chunks: list, pctx: Any, cfg: ModelConfig, folder: str | Path | None = None,
                    *, value_head: bool = False) -> set[str]:
    """Copy the HF weights of `folder` (default cfg.hf_path) into this rank's chunks. Returns the
    names of local tensors that have no HF source (a fresh value head) for the caller to init.
    No communication."""
    checked = check_hf_folder(cfg, folder, value_head=value_head)
    fresh = set()
    for chunk in chunks:
        for name, t in local_tensors([chunk], pctx):
            src = checked.sources.get(EMBEDDING if tied_copy(name, chunk) else name)
            if src is None:
                fresh.add(name)
                continue
            fill_shard(t.data, src, cfg, checked.model_type, checked.files.read, _tp_partition_dim(t),
                       pctx.tp_size, pctx.tp_rank)
    return fresh
