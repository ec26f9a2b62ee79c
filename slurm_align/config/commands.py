"""`slurm-align config explain FIELD`: one setting's entry of the configuration reference (type,
default, bounds, docstring), from the same source as the docs' reference pages (config/reference.py)."""

from __future__ import annotations

import argparse

from slurm_align.config.errors import ConfigError
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.reference import explain
from slurm_align.config.run import RunConfig


def cmd_explain(args: argparse.Namespace) -> int:
    model, what = (ClusterProfile, "cluster profile") if args.profile else (RunConfig, "run config")
    try:
        entry = explain(model, args.field)
    except KeyError as e:
        raise ConfigError([f"{what} field {e.args[0]}"]) from None
    print(f"{entry.path}  ({what})")
    print(f"  type:    {entry.type}")
    print(f"  default: {entry.default}")
    if entry.bounds:
        print(f"  bounds:  {entry.bounds}")
    print(f"  {entry.doc}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="explain a run-config or profile field (the configuration reference)")
    what = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    e = what.add_parser("explain", help="a field's type, default, bounds and meaning, e.g. rollout.mode",
                        description="Print one field's entry of the configuration reference, "
                                    "e.g. `slurm-align config explain rl.kl_loss_coef`.")
    e.add_argument("field", help="dotted path as in an override, e.g. ppo.num_steps or model.lora.rank")
    e.add_argument("--profile", action="store_true",
                   help="a cluster-profile field (e.g. components.actor.nodes) instead of a run-config field")
    e.set_defaults(func=cmd_explain)
