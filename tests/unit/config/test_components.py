"""The component-kind registry (slurm_align/config/components.py): a run declares its components
by asking every registered kind; the profile, the sweep, the job script and status look kinds up."""

from __future__ import annotations

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import ConfigError, load_profile, load_run_config
from slurm_align.config.components import ComponentKind, component_kind, declared_components, leader, register_component
from slurm_align.config.loading import check_against_profile
from slurm_align.slurm.render import Entry, render_script
from slurm_align.slurm.sweep import plan_point

GRPO = REPO_ROOT / "examples" / "grpo_tiny.yaml"
TOY = "plugins=[tests.support.toy_component]"


def one_node_each(profile, *names):
    comps = dict(profile.components)
    for n in names:
        comps[n] = comps["critic"].model_copy(update={"nodes": 1, "tasks_per_node": 1})
    comps["actor"] = comps["actor"].model_copy(update={"nodes": 1})
    return profile.model_copy(update={"components": comps})


def test_a_plugin_kind_is_declared_by_the_runs_that_list_it_in_registration_order():
    plain = load_run_config(GRPO)
    toy = load_run_config(GRPO, [TOY, "rollout.mode=disaggregated"])
    assert plain.components == ("actor",)
    assert toy.components == ("actor", "generator", "toy") == declared_components(toy)
    assert load_run_config(REPO_ROOT / "examples" / "ppo_tiny.yaml").components == ("actor", "critic")
    assert leader().name == "actor" and component_kind("toy").serves


def test_the_sweep_scales_every_declared_component():
    run = load_run_config(GRPO, [TOY, "rollout.mode=disaggregated"])
    profile = one_node_each(load_profile("local-slurm"), "generator", "toy")
    point = plan_point(run, profile, 4, 1, "weak")
    # the profile's 1:1 ratio to the actor kept; the generator's data_parallel follows its ranks
    assert point.component_nodes == {"actor": 4, "generator": 4, "toy": 4}
    assert point.run.generator.data_parallel == 4 and point.run.actor.data_parallel == 4
    ppo = load_run_config(REPO_ROOT / "examples" / "ppo_tiny.yaml", ["sweep.actor_to_critic_nodes='2:1'",
                                                                    "actor.data_parallel=1"])
    assert plan_point(ppo, one_node_each(load_profile("local-slurm")), 4, 1, "weak").component_nodes == \
        {"actor": 4, "critic": 2}   # the critic's own rule


def test_the_job_script_runs_the_kinds_launcher_and_clears_its_address(tmp_path):
    run = load_run_config(GRPO, [TOY])
    script = render_script(run, one_node_each(load_profile("local-slurm"), "toy"), tmp_path, Entry())
    assert "-m tests.programs.toy_component --run-dir" in script
    assert 'rm -f "$SLURM_ALIGN_RUN_DIR/toy_address.json" ' in script
    assert "SLURM_ALIGN_COMPONENTS=actor,toy" in script


def test_a_profile_component_no_kind_has_is_refused_with_the_allowed_ones():
    run = load_run_config(GRPO)
    profile = load_profile("local")
    typo = profile.model_copy(update={"components": {**profile.components, "critc": profile.components["critic"]}})
    with pytest.raises(ConfigError, match=r"components\.critc.*no component kind 'critc'; allowed: actor, critic"):
        check_against_profile(run, typo)


def test_registration_refuses_a_taken_name_a_second_leader_and_a_bad_name():
    with pytest.raises(ValueError, match="already registered"):
        register_component(ComponentKind("critic", "x.y", declared_by=lambda run: False))
    with pytest.raises(ValueError, match="'leads' is taken by 'actor'"):
        register_component(ComponentKind("boss", "x.y", declared_by=lambda run: False, preemption="leads"))
    with pytest.raises(ValueError, match="lower-case letters"):
        register_component(ComponentKind("Bad-Name", "x.y", declared_by=lambda run: False))


def kd_run(*overrides: str, teacher: dict | None = None):
    from slurm_align.config.loading import apply_overrides, read_yaml, validate
    from slurm_align.config.run import RunConfig
    data = apply_overrides(read_yaml(GRPO), ["reward.rule=null", "reward.model=false", "eval.interval=0",
                                             *overrides], str(GRPO))
    data["teacher_model"] = {**data["model"], "init_checkpoint": "/ckpt/teacher", **(teacher or {})}
    return validate(RunConfig, data, "kd")


def test_a_teacher_model_declares_the_teacher_component_unless_colocated():
    assert kd_run().components == ("actor", "teacher")
    assert component_kind("teacher").serves and component_kind("teacher").preemption == "survives"
    assert kd_run("switches.colocated_teacher=true", "actor.data_parallel=2").components == ("actor",)
    with pytest.raises(ConfigError, match=r"teacher_model.init_checkpoint: the teacher's weights are required"):
        kd_run(teacher={"init_checkpoint": None})
    with pytest.raises(ConfigError, match=r"teacher_model.vocab_size=300.*must equal model.vocab_size=260"):
        kd_run(teacher={"vocab_size": 300})
    with pytest.raises(ConfigError, match=r"colocated_teacher.*tensor_parallel and pipeline_parallel must be 1"):
        kd_run("switches.colocated_teacher=true", "actor.tensor_parallel=2", "actor.data_parallel=1")
