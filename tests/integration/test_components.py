"""A component kind registered from a plugin (tests/support/toy_component.py) runs as one more
component of the run's job: on the local profile and in a hetjob on the real local Slurm cluster
it serves, publishes its secret-tagged address, which the actor reads and which refuses a caller
without the secret; killed, the job fails and `status` names it. The actor is a stand-in
(tests/programs/toy_component_actor.py): what is tested is the job around the components."""

from __future__ import annotations

import json
import signal

import psutil
import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.slurm.launch import launch_run
from slurm_align.slurm.render import Entry
from tests.support.preempt_support import cli, logs_text, wait_for

ACTOR = REPO_ROOT / "tests" / "programs" / "toy_component_actor.py"


def toy_run():
    return load_run_config(REPO_ROOT / "examples" / "grpo_tiny.yaml",
                           ["plugins=[tests.support.toy_component]", "actor.data_parallel=1"])


def with_toy(profile):
    comps = {**profile.components, "toy": profile.components["critic"].model_copy(update={"nodes": 1})}
    comps["actor"] = comps["actor"].model_copy(update={"nodes": 1, "tasks_per_node": 1})
    # the toy's launcher and the plugin live in tests/: the ranks import this checkout
    return profile.model_copy(update={"components": comps, "env": {**profile.env, "PYTHONPATH": str(REPO_ROOT)}})


def toy_answers(run_dir) -> list[str]:
    path = run_dir / "toy_answers.txt"
    return path.read_text().split() if path.exists() else []


def test_a_plugin_component_serves_beside_the_actor_on_the_local_profile(tmp_path):
    run_dir = tmp_path / "run"
    job = launch_run(toy_run(), with_toy(load_profile("local")), run_dir, entry=Entry(scripts={"actor": ACTOR}))
    answers = wait_for(lambda: toy_answers(run_dir), "the actor's calls to the toy", timeout=180, job=job)
    assert answers == ["refused", "toy", "ok"], logs_text(run_dir)
    published = json.loads((run_dir / "toy_address.json").read_text())
    assert published["port"] > 0 and len(published["tag"]) == 64
    (run_dir / "end_actor").touch()
    assert job.wait(timeout_s=120) == "COMPLETED", logs_text(run_dir)
    assert job.component_states() == {"actor": "COMPLETED", "toy": "COMPLETED"}


@pytest.mark.slurm
def test_a_plugin_component_in_a_slurm_hetjob_is_named_by_status_when_killed(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    job = launch_run(toy_run(), with_toy(load_profile("local-slurm")), run_dir,
                     entry=Entry(scripts={"actor": ACTOR}))
    try:
        assert wait_for(lambda: toy_answers(run_dir), "the actor's calls to the toy", timeout=300,
                        job=job) == ["refused", "toy", "ok"], logs_text(run_dir)
        toy = next(p for p in psutil.process_iter(["cmdline"])
                   if "tests.programs.toy_component" in " ".join(p.info["cmdline"] or [])
                   and str(run_dir) in " ".join(p.info["cmdline"] or []))
        toy.send_signal(signal.SIGKILL)
        assert job.wait(timeout_s=180, poll_s=0.2) == "FAILED", logs_text(run_dir)
        status = json.loads(cli("status", str(run_dir), "--json", timeout=60).stdout)
        assert (status["state"], status["failed"]["component"]) == ("FAILED", "toy"), status
        assert set(status["components"]) == {"actor", "toy"}
    finally:
        cli("cancel", str(run_dir), timeout=60)
