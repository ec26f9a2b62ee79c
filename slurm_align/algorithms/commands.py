"""`slurm-align train {sft,rm,dpo,kto,kd} CONFIG --profile NAME [--run-dir DIR] [--follow] [a.b=c ...]`

Loads and validates the run config (algorithm set from the subcommand) against the profile,
writes the resolved config into the run directory and launches it (local mpirun ranks or a
plain Slurm job); every rank runs launchers/train.py.

`slurm-align eval MODEL --data FILE [--config CONFIG] [--samples N] [--temperature T]
[--engine E] [--profile NAME] [--out DIR] [--follow] [a.b=c ...]` (--run-dir DIR: the same as --out)

Evaluates a checkpoint (an iter_* folder or a run's checkpoints folder) or a Hugging Face
folder on a data set as a job of its own (the actor component only; launchers/evaluate.py runs
algorithms/eval_main.py on every rank). The model's shape and the scorer come from CONFIG,
by default the config.yaml of the run the checkpoint belongs to (an HF folder needs --config).

`slurm-align generate MODEL --data FILE [--config CONFIG] [--samples N] [--temperature T]
[--top-k-logprobs K] [--shard-size S] [--engine E] [--profile NAME] [--run-dir DIR] [--follow]`

Samples responses (their log-probs and, with K, the model's top-K log-probs per response token)
for every prompt of a data set into RUN_DIR/generate/shard_*.jsonl, on the same standalone
actor as eval (algorithms/generate.py); rerun with the same --run-dir to resume.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import check_against_profile, load_run_config
from slurm_align.rundir import new_run_dir
from slurm_align.slurm.choose import choose_profile, default_run_root
from slurm_align.slurm.commands import _report_final, add_run_arguments, load_inputs
from slurm_align.slurm.launch import launch_run
from slurm_align.slurm.render import Entry

TRAIN_ALGORITHMS = {"sft": "supervised fine-tuning on {input, output} JSONL",
                    "rm": "reward model on {prompt, chosen, rejected} JSONL (Bradley-Terry) or on {input, output, "
                          "<attribute>...} (loss.name=regression)",
                    "dpo": "DPO / IPO / RPO (loss.options.preference_loss) against the frozen initial policy on "
                           "{prompt, chosen, rejected} JSONL",
                    "kto": "KTO against the frozen initial policy on {input, output, label} JSONL",
                    "kd": "offline knowledge distillation on a teacher's top-K log-probs (slurm-align generate "
                          "--top-k-logprobs K: its generate/ folder or a shard file)"}


def cmd_train(args: argparse.Namespace) -> int:
    out, err = Console(), Console(stderr=True)
    run, profile, run_dir = load_inputs(args, algorithm=args.algorithm)
    job = launch_run(run, profile, run_dir)
    out.print(f"{args.algorithm}: job [bold]{job.job_id}[/] ({job.record.backend}, profile {profile.name})")
    out.print(f"run directory: {job.run_dir.root}  (metrics: {job.run_dir.root / 'metrics.jsonl'})")
    if args.follow:
        return _report_final(job, job.wait(console=err))
    return 0


def model_overrides(model: Path, config: Path | None, flag: str = "MODEL") -> tuple[Path, list[str]]:
    """The run config to start from and the overrides that point it at `model` (an iter_* folder,
    a run's checkpoints folder or a Hugging Face folder): the model a standalone job (eval,
    generate) loads. `config` None: the config.yaml of the run the checkpoint belongs to."""
    model = model.expanduser().resolve()
    if not model.exists():
        raise ConfigError.at(flag, str(model), "no such checkpoint or Hugging Face folder")
    hf = (model / "config.json").is_file()
    if config is None:   # the run the checkpoint belongs to
        config = next((p / "config.yaml" for p in [model, *model.parents] if (p / "config.yaml").is_file()), None)
        if config is None or hf:
            raise ConfigError.at("--config", None, f"{model} is {'a Hugging Face folder' if hf else 'not inside a run'}"
                                 " directory: give the run config (model shape, tokenizer, scorer) with --config")
    where = [f"model.hf_path={model}", "model.init_checkpoint=null"] if hf else [f"model.init_checkpoint={model}"]
    # eval.standalone: the actor component alone (RunConfig.components)
    return Path(config), [*where, "eval.standalone=true", "run_dir=null"]


def attribute_overrides(text: str | None) -> list[str]:
    """`--attributes correctness=4,verbosity=2` as the overrides of eval.attributes (SteerLM:
    generate conditioned on those values), in the order given."""
    if not text:
        return []
    out = []
    for item in text.split(","):
        name, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or not name.strip() or number is None:
            raise ConfigError.at("--attributes", text, f"{item!r} is not name=number; give e.g. "
                                 "correctness=4,verbosity=2 (the regression reward model's attribute names)")
        out.append(f"eval.attributes.{name.strip()}={number}")
    return ["eval.attributes={}", *out]


def eval_overrides(model: Path, args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The config to start from and the overrides that make it an evaluation job of `model`."""
    config, where = model_overrides(model, args.config)
    sampled = [f"eval.samples={args.samples}"] + ([f"eval.temperature={args.temperature}"]
                                                  if args.temperature is not None else [])
    engine = [f"generation.engine={args.engine}"] if args.engine else []
    return config, [*where, f"eval.val_path={args.data}", "eval.interval=1", *sampled, *engine,
                    *attribute_overrides(args.attributes), *args.overrides]


def cmd_eval(args: argparse.Namespace) -> int:
    out, err = Console(), Console(stderr=True)
    config, overrides = eval_overrides(args.model, args)
    run = load_run_config(config, overrides)
    if not run.spec.rollout:
        raise ConfigError.at("algorithm", run.algorithm, "slurm-align eval takes a rollout run's config (ppo, grpo, "
                             "...): it generates with the run's engine and scores with eval.scorer or reward.rule")
    if run.eval.scorer is None and run.reward.rule is None:
        raise ConfigError.at("eval.scorer", None, "nothing scores the answers: set eval.scorer=module:function")
    profile = choose_profile(args.profile, args.profile_set)
    check_against_profile(run, profile, source=config)
    run_dir = args.run_dir or new_run_dir(default_run_root(profile), "eval")
    job = launch_run(run, profile, run_dir, entry=Entry("evaluate"))
    out.print(f"eval: job [bold]{job.job_id}[/] ({job.record.backend}, profile {profile.name})")
    out.print(f"run directory: {job.run_dir.root}  (results: {job.run_dir.root / 'eval'})")
    if not args.follow:
        return 0
    code = _report_final(job, job.wait(console=err))
    for path in sorted((job.run_dir.root / "eval").glob("metrics_step_*.json")):
        out.print(json.dumps(json.loads(path.read_text()), indent=1))
    return code


def generate_args(args: argparse.Namespace) -> list[str]:
    """The launcher's arguments (launchers/generate.py) from the command's."""
    for flag, value, low in (("--samples", args.samples, 1), ("--top-k-logprobs", args.top_k_logprobs, 0),
                             ("--shard-size", args.shard_size, 1)):
        if value < low:
            raise ConfigError.at(flag, value, f"must be at least {low}")
    if args.samples > 1 and args.temperature == 0:
        raise ConfigError.at("--temperature", 0, f"--samples {args.samples} greedy answers are all the same: "
                             "set a temperature above 0")
    data = args.data.expanduser().resolve()
    if not data.exists():
        raise ConfigError.at("--data", str(data), "no such file or folder")
    extra = ["--data", str(data), "--samples", str(args.samples), "--temperature", str(args.temperature),
             "--top-k-logprobs", str(args.top_k_logprobs), "--shard-size", str(args.shard_size)]
    return extra + (["--max-new-tokens", str(args.max_new_tokens)] if args.max_new_tokens else [])


def cmd_generate(args: argparse.Namespace) -> int:
    out, err = Console(), Console(stderr=True)
    config, where = model_overrides(args.model, args.config)
    engine = [f"generation.engine={args.engine}"] if args.engine else []
    run = load_run_config(config, [*where, *engine, *attribute_overrides(args.attributes), *args.overrides])
    if not run.spec.rollout:
        raise ConfigError.at("algorithm", run.algorithm, "slurm-align generate takes a rollout run's config (ppo, "
                             "grpo, ...): it generates with the run's engine settings (generation.*)")
    profile = choose_profile(args.profile, args.profile_set)
    check_against_profile(run, profile, source=config)
    run_dir = args.run_dir or new_run_dir(default_run_root(profile), "generate")
    job = launch_run(run, profile, run_dir, entry=Entry("generate", extra_args={"actor": generate_args(args)}))
    out.print(f"generate: job [bold]{job.job_id}[/] ({job.record.backend}, profile {profile.name})")
    out.print(f"run directory: {job.run_dir.root}  (shards: {job.run_dir.root / 'generate'})")
    if not args.follow:
        return 0
    return _report_final(job, job.wait(console=err))


def standalone_parser(sub, name: str, help_text: str, *, data: str, samples: str,
                      temperature: float | None) -> argparse.ArgumentParser:
    """The arguments `eval` and `generate` share: a model, a data set and how to sample it
    (both run the actor component alone over the data: algorithms/standalone.py)."""
    p = sub.add_parser(name, help=help_text)
    p.add_argument("model", type=Path, help="checkpoint (iter_* or a checkpoints folder) or Hugging Face folder")
    p.add_argument("--data", type=Path, required=True, help=data)
    p.add_argument("--config", type=Path, default=None,
                   help="run config (default: config.yaml of the run the checkpoint is in)")
    p.add_argument("--samples", type=int, default=1, help=samples)
    p.add_argument("--temperature", type=float, default=temperature, help="sampling temperature (0: greedy)")
    p.add_argument("--engine", default=None, help="generation engine (torch, naive, vllm, trtllm)")
    p.add_argument("--attributes", default=None, metavar="NAME=V,...",
                   help="SteerLM: condition every prompt on these attribute values, e.g. correctness=4,verbosity=2 "
                        "(eval.attributes; the format attribute-conditioned SFT trained on)")
    return p


def register(sub) -> None:
    p = sub.add_parser("train", help="train with SFT, a reward model, DPO or KTO (one job component)")
    algos = p.add_subparsers(dest="algorithm", required=True, metavar="ALGORITHM")
    for name, help_text in TRAIN_ALGORITHMS.items():
        a = algos.add_parser(name, help=help_text)
        add_run_arguments(a)
        a.add_argument("--follow", action="store_true", help="wait for the job and show its state")
        a.set_defaults(func=cmd_train)

    e = standalone_parser(sub, "eval", "evaluate a checkpoint or HF model on a data set (pass@k; a job of its own)",
                          data="prompts with the scorer's fields (any data format)",
                          samples="answers per prompt (pass@k up to this)", temperature=None)
    add_run_arguments(e, with_config=False)
    # --out is the eval command's name for its output folder; --run-dir (the other commands') also works
    e.add_argument("--out", dest="run_dir", type=Path, default=None, metavar="DIR",
                   help="where the results go: DIR/eval/step_<N>.jsonl (every sample with its score, per prompt) "
                        "and DIR/eval/metrics_step_<N>.json; same as --run-dir")
    e.add_argument("--follow", action="store_true", help="wait for the job, then print its metrics")
    e.set_defaults(func=cmd_eval)

    g = standalone_parser(sub, "generate", "sample responses (and top-K log-probs) for a data set, in resumable "
                          "shards", data="prompts (any data format)", samples="responses per prompt", temperature=1.0)
    g.add_argument("--top-k-logprobs", type=int, default=0,
                   help="also store each response position's top-K log-probs of the model (0: none)")
    g.add_argument("--shard-size", type=int, default=64, help="prompts per output shard (the unit of resuming)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="default: generation.max_new_tokens")
    add_run_arguments(g, with_config=False)
    g.add_argument("--follow", action="store_true", help="wait for the job")
    g.set_defaults(func=cmd_generate)
