"""One example per CLI command, shown at the end of its `--help` and in the generated CLI reference.

The examples live in one table, keyed by the command's words, rather than beside each
`add_parser` call: every area keeps its own parser code, and a test
(tests/unit/test_cli_help.py) walks the parser tree so that a new command without an example, or
an example the parser (or the run config) refuses, fails CI. Paths are the repository's own
examples, so an example can be pasted from the repository root; `RUN_DIR`, `CHECKPOINT` and
the like are the user's.
"""

from __future__ import annotations

import argparse

EXAMPLES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("submit",): (
        "slurm-align submit examples/grpo_tiny.yaml --profile local --follow",
        "slurm-align submit examples/ppo_tiny.yaml --profile local-slurm --run-dir runs/ppo ppo.num_steps=40",
    ),
    ("render",): (
        "slurm-align render examples/ppo_tiny.yaml --profile local-slurm",
    ),
    ("pipeline",): (
        "slurm-align pipeline examples/pipeline_tiny.yaml --profile local-slurm --run-dir runs/pipeline",
    ),
    ("status",): (
        "slurm-align status runs/ppo",
    ),
    ("cancel",): (
        "slurm-align cancel runs/ppo",
    ),
    ("train", "sft"): (
        "slurm-align train sft examples/sft_tiny.yaml --profile local --run-dir runs/tiny/sft --follow",
    ),
    ("train", "rm"): (
        "slurm-align train rm examples/rm_tiny.yaml --profile local --run-dir runs/tiny/rm --follow",
    ),
    ("train", "dpo"): (
        "slurm-align train dpo examples/dpo_tiny.yaml --profile local --follow "
        "model.init_checkpoint=runs/tiny/sft/checkpoints/sft loss.options.preference_loss=ipo",
    ),
    ("train", "kto"): (
        "slurm-align train kto examples/dpo_tiny.yaml --profile local --follow "
        "model.init_checkpoint=runs/tiny/sft/checkpoints/sft",
    ),
    ("train", "kd"): (
        "slurm-align train kd examples/sft_tiny.yaml --profile local --follow "
        "data.train_path=runs/teacher/generate model.init_checkpoint=runs/tiny/sft/checkpoints/sft",
    ),
    ("eval",): (
        "slurm-align eval runs/tiny/ppo/checkpoints/actor --data examples/synthetic/prompts_val.jsonl "
        "--profile local --samples 8 --temperature 1.0",
        "slurm-align eval runs/steerlm/sft/checkpoints/sft --config examples/grpo_tiny.yaml "
        "--data examples/synthetic/prompts_val.jsonl --attributes correctness=4,verbosity=2 model.max_seq_len=80",
    ),
    ("label",): (
        "slurm-align label runs/cai/responses/generate --config examples/cai_tiny.yaml --out runs/cai/labels.jsonl "
        "judge.model.init_checkpoint=runs/cai/judge-model/checkpoints/sft",
        "slurm-align label runs/cai/responses/generate --config examples/cai_tiny.yaml --out runs/cai/random.jsonl "
        "--random-labels",
    ),
    ("revise",): (
        "slurm-align revise runs/cai/responses/generate --config examples/cai_tiny.yaml "
        "--out runs/cai/revisions.jsonl judge.model.init_checkpoint=runs/cai/judge-model/checkpoints/sft",
    ),
    ("steerlm-label",): (
        "slurm-align steerlm-label runs/steerlm/rm/checkpoints/rm --data examples/synthetic/sft_train.jsonl "
        "--out runs/steerlm/labelled.jsonl",
    ),
    ("generate",): (
        "slurm-align generate runs/tiny/ppo/checkpoints/actor --data examples/synthetic/prompts.jsonl "
        "--profile local --samples 4 --top-k-logprobs 8",
    ),
    ("analyze", "breakdown"): (
        "slurm-align analyze breakdown runs/tiny/ppo --per-step",
    ),
    ("analyze", "trace"): (
        "slurm-align analyze trace runs/tiny/ppo",
    ),
    ("analyze", "settings"): (
        "slurm-align analyze settings runs/sweep-lr --metric val/score",
    ),
    ("analyze", "scaling"): (
        "slurm-align analyze scaling runs/sweep-nodes",
    ),
    ("analyze", "heldout"): (
        "slurm-align analyze heldout runs/tiny/ppo",
    ),
    ("sweep",): (
        "slurm-align sweep examples/ppo_tiny.yaml --profile local-slurm --nodes 1,2,4",
        "slurm-align sweep examples/grpo_tiny.yaml --profile local-slurm --set ppo.actor_lr=1e-5,3e-5 "
        "--sweep-dir runs/sweep-lr",
    ),
    ("import", "hf"): (
        "slurm-align import hf HF_DIR runs/imported",
    ),
    ("export", "hf"): (
        "slurm-align export hf runs/tiny/ppo/checkpoints/actor runs/ppo-hf --dtype bfloat16",
    ),
    ("config", "explain"): (
        "slurm-align config explain rollout.mode",
        "slurm-align config explain components.actor.nodes --profile",
    ),
    ("plan",): (
        "slurm-align plan examples/plans/llama3_8b_ppo.yaml --profile cluster_profiles/example-gpu-cluster.yaml",
        "slurm-align plan examples/ppo_tiny.yaml --profile local",
    ),
}


def leaves(parser: argparse.ArgumentParser,
           words: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """(words, parser, one-line purpose) of every command that has no subcommands, depth first."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            purpose = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                below = leaves(sub, (*words, name))
                out += below or [((*words, name), sub, purpose.get(name, ""))]
    return out


def add_examples(parser: argparse.ArgumentParser) -> None:
    """Give every command its purpose as a description (when it has none) and its examples as an
    epilog, kept as written (argparse would rewrap them into one line)."""
    for words, sub, purpose in leaves(parser):
        examples = EXAMPLES.get(words, ())
        if not sub.description and purpose:
            sub.description = purpose[:1].upper() + purpose[1:] + "."
        if examples:
            sub.epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
            sub.formatter_class = argparse.RawDescriptionHelpFormatter
