"""`slurm-align import hf HF_DIR OUT_DIR` and `slurm-align export hf CHECKPOINT OUT_DIR`."""

from __future__ import annotations

import argparse
import warnings
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from slurm_align.config.errors import ConfigError


@contextmanager
def _quiet_dependencies():
    """megatron warns at import that Apex/TE are missing, and torch's checkpoint code about its own
    deprecations: nothing a user of these commands can act on, so not on their console."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(megatron|torch)\.")
        yield


def cmd_import(args: argparse.Namespace) -> int:
    with _quiet_dependencies():
        # deferred: the CLI stays fast (the exporter imports torch and megatron, seconds)
        from slurm_align.models.hf.exporter import import_hf
        out = import_hf(Path(args.hf_dir), Path(args.out_dir))
    Console().print(f"imported {args.hf_dir} -> {out} (use it as model.init_checkpoint)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    with _quiet_dependencies():
        # deferred: the CLI stays fast (checkpoint and exporter import torch and megatron, seconds)
        from slurm_align.models.checkpoint import CheckpointError
        from slurm_align.models.hf.exporter import export_hf
        try:
            out = export_hf(Path(args.checkpoint), Path(args.out_dir),
                            run_config=Path(args.config) if args.config else None, dtype=args.dtype,
                            adapter=args.adapter)
        except CheckpointError as e:
            raise ConfigError([str(e)], args.checkpoint) from None
    how = ("peft: PeftModel.from_pretrained(base, ...)" if args.adapter
           else f"transformers: from_pretrained({str(out)!r})")
    Console().print(f"exported {args.checkpoint} -> {out} ({how})")
    return 0


def register(sub) -> None:
    p = sub.add_parser("import", help="convert a model from another format into a slurm-align checkpoint")
    kinds = p.add_subparsers(dest="format", required=True, metavar="FORMAT")
    hf = kinds.add_parser("hf", help="a local Hugging Face folder (Llama, Qwen2, Mistral, GPT-2; causal LM "
                                     "or *ForSequenceClassification reward model)")
    hf.add_argument("hf_dir", help="folder with config.json and *.safetensors")
    hf.add_argument("out_dir", help="new checkpoint folder (must not exist or be empty)")
    hf.set_defaults(func=cmd_import)

    p = sub.add_parser("export", help="write a slurm-align checkpoint in another format")
    kinds = p.add_subparsers(dest="format", required=True, metavar="FORMAT")
    hf = kinds.add_parser("hf", help="a Hugging Face folder that transformers' from_pretrained loads")
    hf.add_argument("checkpoint", help="an iter_* checkpoint folder (or a checkpoints/<name> folder: its newest)")
    hf.add_argument("out_dir", help="new output folder (must not exist or be empty)")
    hf.add_argument("--config", help="run config of the checkpoint (default RUN_DIR/config.yaml beside "
                                     "RUN_DIR/checkpoints/)")
    hf.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="dtype of the written weights (default float32, as trained)")
    hf.add_argument("--adapter", action="store_true",
                    help="a LoRA run's adapters only, as a PEFT adapter folder (adapter_config.json, "
                         "adapter_model.safetensors); default: the weights with the adapters merged in")
    hf.set_defaults(func=cmd_export)
