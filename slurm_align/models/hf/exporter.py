"""`slurm-align import hf` and `slurm-align export hf`: HF folder <-> sharded slurm-align checkpoint.

Both run in one process (a world of one rank). Export loads the checkpoint, saved under any
TP/PP, into a TP=1, PP=1 model through the same dist_checkpointing path that training uses (it
reshards), takes `full_state_dict` and writes the HF tensors one by one. Chosen over
`dist_checkpointing.load_plain_tensors`, which returns Transformer Engine names, layers stacked
per name and SwiGLU halves as the sharded factory stored them: a second naming to translate,
where the loaded model already gives weights.py's naming that mapping.py converts.

Which model a checkpoint holds: an imported checkpoint carries its ModelConfig in its common
state; a training checkpoint RUN_DIR/checkpoints/<name>/iter_N takes it from RUN_DIR/config.yaml
(`model`, or `critic_model` for the PPO critic; rm and critic checkpoints hold value models).
Value models (rm and critic checkpoints) are written as *ForSequenceClassification: the value
head's weight becomes `score.weight`; HF's score has no bias, so ours (a constant shift of every
reward, which a Bradley-Terry loss never sees) is dropped.
A LoRA checkpoint (adapters only, common["lora_base"] naming its base) is loaded onto its base
and written merged (W + scale * B A), or with `adapter=True` as a PEFT adapter folder
(peft_adapter.py); an adapter export of a checkpoint without LoRA is refused before anything
is written.
Writes are atomic: everything goes into a hidden sibling folder that is renamed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pydantic
import torch
from megatron.core import dist_checkpointing
from safetensors.torch import save_file

from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import read_yaml
from slurm_align.config.run import ModelConfig
from slurm_align.models.checkpoint import (
    MANIFEST,
    find_latest,
    iter_dir,
    load_weights,
    save_checkpoint,
    verify_checkpoint,
)
from slurm_align.models.gpt import build_gpt
from slurm_align.models.hf.config import SUPPORTED, export_model_type, hf_config_dict, read_hf_config
from slurm_align.models.hf.loader import INDEX, check_hf_folder
from slurm_align.models.hf.mapping import sources, to_hf
from slurm_align.models.hf.peft_adapter import peft_tensors, write_peft_adapter
from slurm_align.models.lora import attach_lora, merged
from slurm_align.models.weights import local_tensors
from slurm_align.parallel.bootstrap import init_distributed
from slurm_align.parallel.layout import initialize_model_parallel
from slurm_align.rundir import fsync_dir

MAX_SHARD_BYTES = 5 * 1024**3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")
VALUE_CHECKPOINTS = ("rm", "critic")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CheckpointModel:
    """What a checkpoint holds: its model config, whether it has a value head, and the HF
    folder it came from (None for slurm-align's own models, or when the folder is gone)."""

    config: ModelConfig
    value_head: bool
    source: Path | None


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
    fsync_dir(root)


def check_target(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError([f"export target {out_dir} exists and is not empty; give a new or empty folder"], out_dir)


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename the finished temp folder onto the (absent or empty) target."""
    _fsync_tree(tmp)
    if out_dir.is_dir():
        out_dir.rmdir()  # empty (checked before anything was written)
    os.replace(tmp, out_dir)
    fsync_dir(out_dir.parent)


def _temp_beside(out_dir: Path) -> Path:
    tmp = out_dir.parent / f".{out_dir.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _model_config(data: dict, source: Path) -> ModelConfig:
    """A saved (resolved) model section, validated without re-reading its HF folder."""
    try:
        return ModelConfig.model_validate({**data, "hf_path": None})
    except pydantic.ValidationError as e:
        raise ConfigError.from_validation(e, source, prefix="model") from None


def _source_folder(data: dict) -> Path | None:
    path = data.get("hf_path")
    return Path(path) if path and (Path(path) / "config.json").is_file() else None


def checkpoint_model(ckpt: Path, run_config: Path | None = None) -> CheckpointModel:
    """The model of checkpoint folder `ckpt` (see the module docstring)."""
    common = dist_checkpointing.load_common_state_dict(str(ckpt)).get("common", {})
    if "model_config" in common and run_config is None:
        data = common["model_config"]
        return CheckpointModel(_model_config(data, ckpt), bool(common.get("value_head")), _source_folder(data))
    run_config = run_config or ckpt.parent.parent.parent / "config.yaml"
    if not run_config.is_file():
        raise ConfigError([f"cannot tell which model {ckpt} holds: no run config at {run_config}; "
                           "give one with --config RUN_DIR/config.yaml"], ckpt)
    data = read_yaml(run_config)
    name = ckpt.parent.name
    section = data.get("critic_model") if name == "critic" and data.get("critic_model") else data.get("model", {})
    return CheckpointModel(_model_config(section or {}, run_config), name in VALUE_CHECKPOINTS,
                           _source_folder(section or {}))


def resolve_checkpoint(path: Path) -> Path:
    """An iter_* folder, or the newest complete one under a checkpoints/<name> folder."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    latest = find_latest(path)
    if latest is None:
        raise ConfigError([f"{path} is neither a complete checkpoint (no {MANIFEST}) nor a folder of them"], path)
    return latest


class _ShardWriter:
    """safetensors files of at most `max_bytes` each, named as transformers names them."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.shards: list[dict[str, torch.Tensor]] = [{}]   # the last one is being filled
        self.names: list[list[str]] = []   # the tensors of each file written
        self.sizes = [0]

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.shards[-1] and self.sizes[-1] + nbytes > self.max_bytes:
            self.flush_last()
            self.shards.append({})
            self.sizes.append(0)
        self.shards[-1][name] = t
        self.sizes[-1] += nbytes

    def flush_last(self) -> None:
        # Written now under a provisional name (the total is not known yet) and freed.
        save_file(self.shards[-1], str(self.folder / f"part-{len(self.shards):05d}.safetensors"),
                  metadata={"format": "pt"})
        self.names.append(list(self.shards[-1]))
        self.shards[-1] = {}   # freed

    def finish(self) -> None:
        self.flush_last()
        n = len(self.shards)
        if n == 1:
            os.replace(self.folder / "part-00001.safetensors", self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.names, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / f"part-{i:05d}.safetensors", self.folder / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": sum(self.sizes)}, "weight_map": weight_map}
        (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _single_rank_context():
    """A world of one rank with megatron's parallel state (TP=1, PP=1)."""
    return initialize_model_parallel(init_distributed(), 1, 1)


def _write_side_files(tmp: Path, source: Path | None, config: dict) -> None:
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    if source is not None and (source / "generation_config.json").is_file():
        generation = json.loads((source / "generation_config.json").read_text())
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)


def _lora_base(ckpt: Path, common: dict, cfg: ModelConfig, pctx) -> list:
    """The base model of a LoRA checkpoint (its common["lora_base"]), adapters attached and loaded."""
    base = common.get("lora_base") or {}
    if cfg.lora is None or not base:
        raise ConfigError([f"{ckpt} holds LoRA adapters, but its run config has no model.lora (or the "
                           "checkpoint no lora_base): give the run's config with --config"], ckpt)
    if base.get("init_checkpoint"):
        chunks = build_gpt(cfg, pctx, init=False)
        load_weights(base["init_checkpoint"], chunks)
    elif base.get("hf_path"):
        if not (Path(base["hf_path"]) / "config.json").is_file():
            raise ConfigError([f"the base of {ckpt}, HF folder {base['hf_path']}, is gone"], ckpt)
        chunks = build_gpt(cfg.model_copy(update={"hf_path": Path(base["hf_path"]), "init_checkpoint": None}), pctx)
    else:   # a base drawn from the run's seed
        chunks = build_gpt(cfg, pctx, seed=int(base["seed"]))
    attach_lora(chunks, cfg.lora, pctx, int(base["seed"]))
    load_weights(ckpt, chunks)
    return chunks


def export_hf(checkpoint: Path, out_dir: Path, *, run_config: Path | None = None, dtype: str = "float32",
              max_shard_bytes: int = MAX_SHARD_BYTES, adapter: bool = False) -> Path:
    """Write the checkpoint as a HF folder `out_dir` that transformers' from_pretrained loads
    (LoRA: merged weights), or with `adapter` its LoRA adapters as a PEFT folder."""
    out_dir = Path(out_dir)
    check_target(out_dir)
    ckpt = resolve_checkpoint(Path(checkpoint))
    verify_checkpoint(ckpt)
    common = dist_checkpointing.load_common_state_dict(str(ckpt)).get("common", {})
    if adapter and not common.get("lora"):
        raise ConfigError([f"export hf --adapter: {ckpt} has no LoRA adapters (its run trained the full "
                           "weights, model.lora unset); export it without --adapter"], ckpt)
    held = checkpoint_model(ckpt, run_config)
    cfg = held.config
    base = read_hf_config(held.source) if held.source else None
    model_type = export_model_type(cfg, SUPPORTED.get((base or {}).get("architectures", [""])[0])
                                   if base else None)
    srcs = sources(cfg, model_type, value_head=held.value_head, score_head=held.value_head)
    pctx = _single_rank_context()
    try:
        if common.get("lora"):
            chunks = _lora_base(ckpt, common, cfg, pctx)
        else:
            chunks = build_gpt(cfg, pctx, value_head=held.value_head, init=False)  # the checkpoint sets all
            load_weights(ckpt, chunks)
        if adapter:
            adapter_tensors = peft_tensors(chunks, cfg, model_type, srcs)
        else:
            with merged(chunks):   # LoRA: W + scale * B A (no-op without adapters)
                # TP=1, PP=1: the local tensors are the full ones (full_state_dict would copy them all).
                full = {name: t.detach() for name, t in local_tensors(chunks, pctx)}
        del chunks
    finally:
        pctx.destroy()
    tmp = _temp_beside(out_dir)
    if adapter:
        try:
            write_peft_adapter(tmp, adapter_tensors, cfg, str(held.source) if held.source else None)
            _publish(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out_dir
    try:
        writer = _ShardWriter(tmp, max_shard_bytes)
        for name, src in srcs.items():
            for hf_name, t in to_hf(src, full.pop(name), cfg, model_type).items():
                writer.add(hf_name, t.to(DTYPES[dtype]).contiguous())
        writer.finish()
        config = hf_config_dict(cfg, model_type, base, value_head=held.value_head)
        config["dtype"] = dtype
        _write_side_files(tmp, held.source, config)
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def import_hf(hf_dir: Path, out_dir: Path) -> Path:
    """Write the HF folder `hf_dir` as a sharded slurm-align checkpoint `out_dir` (usable as
    model.init_checkpoint under any TP/PP). A *ForSequenceClassification folder gives a value
    model (its `score` head), any other a causal LM."""
    out_dir = Path(out_dir)
    check_target(out_dir)
    try:
        cfg = ModelConfig.model_validate({"hf_path": str(hf_dir)})
    except pydantic.ValidationError as e:
        inner = (e.errors()[0].get("ctx") or {}).get("error")
        if isinstance(inner, ConfigError):  # the folder's own error names its file already
            raise inner from None
        raise ConfigError.from_validation(e, Path(hf_dir) / "config.json", prefix="model") from None
    arch = (read_hf_config(hf_dir).get("architectures") or [""])[0]
    value_head = arch.endswith("ForSequenceClassification")
    check_hf_folder(cfg, value_head=value_head)  # bad input fails here, before anything is written
    pctx = _single_rank_context()
    tmp = _temp_beside(out_dir)
    try:
        chunks = build_gpt(cfg, pctx, value_head=value_head)
        common = {"model_config": cfg.model_dump(mode="json"), "value_head": value_head}
        save_checkpoint(tmp, 0, chunks, None, common)
        os.replace(iter_dir(tmp, 0), tmp / "checkpoint")
        _publish(tmp / "checkpoint", out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        pctx.destroy()
    return out_dir
