"""`slurm-align steerlm-label RM --data SFT.jsonl --out LABELLED.jsonl [--config CONFIG] [a.b=c ...]`

SteerLM's labelling step in batch (algorithms/steerlm.py): a regression reward model (a run of
`slurm-align train rm` with loss.name=regression; its config names the attributes) predicts the
attributes of every {input, output} row, and the labelled rows (each input conditioned on its
rounded attributes, the raw values under their names) are written for attribute-conditioned SFT.
Runs in this process on one rank, as `slurm-align label` does with a local judge: a small model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import load_run_config
from slurm_align.config.run import RunConfig

# torch, mpi4py and the model code are imported by the command when it runs, not by the CLI.


def rm_config(model: Path, config: Path | None, overrides: list[str]) -> tuple[RunConfig, list[str]]:
    """The reward model's run config pointed at `model`, and its attribute names; a clear error
    where it is not a regression reward model."""
    model = model.expanduser().resolve()
    if not model.exists():
        raise ConfigError.at("RM", str(model), "no such checkpoint (an iter_* folder or a run's checkpoints folder)")
    if config is None:   # the run the checkpoint belongs to
        config = next((p / "config.yaml" for p in [model, *model.parents] if (p / "config.yaml").is_file()), None)
        if config is None:
            raise ConfigError.at("--config", None, f"{model} is not inside a run directory: give the reward "
                                 "model's run config with --config")
    run = load_run_config(config, [f"model.init_checkpoint={model}", *overrides])
    spec, options = run.trainer_loss() if run.spec.trainer is not None else (None, None)
    if run.algorithm != "rm" or spec is None or options is None or spec.name != "regression":
        raise ConfigError.at("loss.name", getattr(spec, "name", None),
                             f"algorithm {run.algorithm}: SteerLM labels with a regression reward model (algorithm rm, "
                             "loss.name=regression: model.num_labels outputs, one per attribute), not a scalar "
                             f"reward model (model.num_labels={run.model.num_labels})", config)
    return run, list(options.attributes)


def cmd_steerlm_label(args: argparse.Namespace) -> int:
    run, names = rm_config(args.rm, args.config, args.overrides)
    data = args.data.expanduser().resolve()
    if not data.is_file():
        raise ConfigError.at("--data", str(data), "no such file (SFT rows {input, output} JSONL)")
    import torch.distributed  # noqa: F401  (before mpi4py: the bootstrap's order)
    from mpi4py import MPI

    from slurm_align.algorithms.steerlm import predict_attributes, write_labelled
    from slurm_align.data.datasets import TooLong
    from slurm_align.losses.regression import AttributeDataset
    from slurm_align.models.tokenizer import build_tokenizer
    from slurm_align.models.worker import ModelWorker
    from slurm_align.parallel.bootstrap import init_distributed, shutdown_distributed
    from slurm_align.parallel.layout import initialize_model_parallel

    ds = AttributeDataset(data, build_tokenizer(run.model), run.model.max_seq_len, names, require_labels=False,
                          columns=run.data.columns, truncate=run.data.truncate)
    chat = next((ds.sft.rows[i] for i in range(len(ds.sft)) if ds.sft.rows[i].is_chat), None)
    if chat is not None:
        raise ConfigError([f"{chat.where}: SteerLM labelling takes plain {{input, output}} rows, not chat "
                           "'messages'"], data)
    env = init_distributed(comm=MPI.COMM_SELF, backend="gloo")
    pctx = initialize_model_parallel(env, 1, 1)
    try:
        worker = ModelWorker(run.model, pctx, seed=run.seed, value_head=True, batching=args.batch_size)
        predictions = predict_attributes(worker, ds)
    except TooLong as e:   # a row longer than the reward model's model.max_seq_len
        raise ConfigError([str(e)], data) from None
    finally:
        pctx.destroy()
        shutdown_distributed(env)
    write_labelled(ds, names, predictions, args.out)
    print(f"steerlm-label: {len(ds)} rows labelled with {', '.join(names)} -> {args.out}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("steerlm-label", help="SteerLM: label SFT rows with a regression reward model's attributes "
                                             "(the data of attribute-conditioned SFT)")
    p.add_argument("rm", type=Path, metavar="RM",
                   help="the regression reward model's checkpoint (iter_* or its run's checkpoints folder)")
    p.add_argument("--data", type=Path, required=True, help="SFT rows {input, output} JSONL to label")
    p.add_argument("--out", type=Path, required=True,
                   help="output JSONL: each row's input conditioned on its attributes, and the raw values")
    p.add_argument("--config", type=Path, default=None,
                   help="the reward model's run config (default: config.yaml of the run the checkpoint is in)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per forward pass")
    p.add_argument("overrides", nargs="*", help="config overrides a.b=c")
    p.set_defaults(func=cmd_steerlm_label)
