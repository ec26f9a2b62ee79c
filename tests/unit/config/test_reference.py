"""The configuration reference generated from the typed config (slurm_align/config/reference.py):
every field of every section reachable from RunConfig and ClusterProfile is in the generated page
with its docstring, type and default, and `slurm-align config explain` prints one field's entry."""

from __future__ import annotations

import html
import re

import pytest
from pydantic import BaseModel

from slurm_align.cli import main
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.reference import default_text, doc_text, explain, markdown, sections, type_text
from slurm_align.config.run import ModelConfig, ParallelConfig, RunConfig


def reachable(model: type[BaseModel]) -> set[type[BaseModel]]:
    """Every model class reachable from `model` through its fields' annotations, found here on its
    own (not with the module's walk), so that a section the generator skips is missed by it only."""
    found, todo = set(), [model]
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.add(cls)
        for info in cls.model_fields.values():
            text = repr(info.annotation)
            todo += [m for m in _all_models() if re.search(rf"\b{m.__name__}\b", text)]
    return found


def _all_models() -> list[type[BaseModel]]:
    import slurm_align.config.engines as engines
    import slurm_align.config.profile as profile
    import slurm_align.config.run as run
    import slurm_align.environments.config as env
    return [v for mod in (run, profile, env, engines) for v in vars(mod).values()
            if isinstance(v, type) and issubclass(v, BaseModel) and v.__module__ == mod.__name__]


def section_text(page: str, heading_anchor: str) -> str:
    """The page's text from the section's heading to the next section's."""
    start = page.index(f"{{ #{heading_anchor} }}\n")
    start = page.rindex("\n## ", 0, start)
    end = page.find("\n## ", start + 1)
    return page[start:end if end >= 0 else None]


@pytest.mark.parametrize("root", [RunConfig, ClusterProfile])
def test_every_field_is_in_the_reference_with_its_doc_type_and_default(root):
    page = markdown(root, "reference")
    secs = {s.model: s for s in sections(root)}
    models = reachable(root)
    assert set(secs) == models, "a model class without its section (or one too many)"
    n = 0
    for cls in models:
        body = section_text(page, re.sub(r"[^a-z0-9]+", "-", secs[cls].path.lower()).strip("-") or "top")
        for name, info in cls.model_fields.items():
            path = f"{secs[cls].path}.{name}".lstrip(".")
            entry = body[body.index(f"`{path}`"):]
            entry = entry[:entry.find("\n`", 1) if "\n`" in entry[1:] else None]
            assert info.description, f"{cls.__name__}.{name} has no docstring"
            # the whole docstring, once Markdown's escapes are undone
            assert doc_text(info.description) in html.unescape(entry).replace("\\", ""), path
            assert default_text(info) in entry, (path, default_text(info))
            n += 1
    assert n == sum(len(c.model_fields) for c in models) > 20


def test_a_class_used_twice_is_one_section_naming_both_paths():
    by_model = {s.model: s for s in sections(RunConfig)}
    assert by_model[ModelConfig].path == "model"
    assert by_model[ModelConfig].also == ("critic_model", "teacher_model", "judge.model")
    assert by_model[ParallelConfig].also == ("critic", "teacher", "generator")


def test_types_show_allowed_values_and_bounds():
    e = explain(RunConfig, "rollout.mode")
    assert (e.type, e.default) == ('"colocated" | "disaggregated"', '"colocated"')
    assert explain(RunConfig, "rl.eps_low").bounds == "> 0, < 1"
    assert explain(ClusterProfile, "components.generator.nodes").bounds == ">= 1"
    assert type_text(RunConfig.model_fields["critic_model"].annotation) == "ModelConfig | null"


def test_explain_names_the_fields_a_wrong_path_could_have_meant():
    with pytest.raises(KeyError, match="rollout has: mode, max_off_policy_steps"):
        explain(RunConfig, "rollout.moed")
    with pytest.raises(KeyError, match="'seed' is int, not a section"):
        explain(RunConfig, "seed.x")


def test_config_explain_command(capsys):
    assert main(["config", "explain", "model.lora.rank"]) == 0
    out = capsys.readouterr().out
    assert "model.lora.rank" in out and "default: 8" in out and "Rank r of every adapter" in out
    assert main(["config", "explain", "--profile", "preempt_grace_s"]) == 0
    assert "GraceTime" in capsys.readouterr().out
    assert main(["config", "explain", "ppo.num_step"]) == 2
    assert "ppo has: num_steps" in capsys.readouterr().err
