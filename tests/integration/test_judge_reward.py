"""The judge as a run's reward (RLAIF, reward.judge_weight): a one-step GRPO run on the local
profile whose only reward is the judge's, (1) from a judge component of the job (an untrained
tiny judge: random init from the run's seed) and (2) from a remote OpenAI-compatible service
(tests/programs/openai_judge_server.py). The rollouts' stored rewards must equal weight x the
judge's own pointwise scores of those samples, computed here in the test process (the same
model, LocalJudge; the same service, RemoteJudge)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from slurm_align.config import load_profile
from slurm_align.config.loading import apply_overrides, read_yaml, validate
from slurm_align.config.run import ModelConfig, RunConfig
from slurm_align.judge.client import LocalJudge
from slurm_align.judge.prompts import JudgeTemplate
from slurm_align.judge.reward import JudgeReward
from slurm_align.models.tokenizer import build_tokenizer
from slurm_align.store.rollouts import RolloutStore
from tests.integration.test_grpo import EXAMPLES, SYNTH, launch
from tests.integration.test_judge import JUDGE_MODEL
from tests.support.critic_support import REPO

WEIGHT = 2.5
ONE_STEP = [f"data.train_path={SYNTH / 'prompts.jsonl'}", "ppo.num_steps=1", "ppo.num_rollout_samples=8",
            "ppo.global_batch_size=16", "rl.n_samples_per_prompt=2", "generation.max_new_tokens=8",
            "generation.prompt_batch_size=4", "ppo.train_micro_batch_size=8", "eval.interval=0",
            "reward.rule=null", "reward.model=false", f"reward.judge_weight={WEIGHT}"]


def judge_run(checkpoint, judge: dict) -> RunConfig:
    base = EXAMPLES / "grpo_tiny.yaml"
    data = apply_overrides(read_yaml(base), [*ONE_STEP, f"model.init_checkpoint={checkpoint}"], str(base))
    data["judge"] = {"template": "pointwise_compact", "principles": ["sorted"], **judge}
    return validate(RunConfig, data, "judge_run")


def samples(run_dir, run: RunConfig) -> tuple[list[str], list[str], np.ndarray]:
    """The stored step's prompts and responses as texts (decoded as the actor decodes them) and rewards."""
    d = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True).read(1)
    tok = build_tokenizer(run.model)
    po, ro = d["prompt_offsets"], d["response_offsets"]
    prompts = [tok.decode(d["prompt_tokens"][a:b].tolist()) for a, b in itertools.pairwise(po)]
    responses = [tok.decode(d["response_tokens"][a:b].tolist()) for a, b in itertools.pairwise(ro)]
    rows = {yaml.safe_load(line)["prompt"] for line in (SYNTH / "prompts.jsonl").read_text().splitlines()}
    assert set(prompts) <= rows, prompts[:3]   # the prompt texts the judge was given
    assert len(prompts) == 16
    return prompts, responses, d["reward"]


def test_a_judge_component_rewards_each_sample_with_its_pointwise_score(tmp_path, sft_checkpoint):
    from tests.support.single_rank import single_rank_world

    run = judge_run(sft_checkpoint, {"model": JUDGE_MODEL})
    assert run.components == ("actor", "judge")
    launch(tmp_path, run)
    prompts, responses, reward = samples(tmp_path / "run", run)
    with single_rank_world() as (_env, pctx):   # the judge's model (its config, the run's seed) here
        from slurm_align.judge.model import JudgeModel
        local = JudgeReward(LocalJudge(JudgeModel.load(ModelConfig(**JUDGE_MODEL), pctx, seed=run.seed)),
                            JudgeTemplate.get("pointwise_compact"), ["sorted"])
        expect = WEIGHT * local.scores(prompts, responses)
    assert np.ptp(expect) > 0   # the scores differ by sample: a per-sample match, not a constant
    np.testing.assert_allclose(reward, expect, rtol=0, atol=1e-5)


def test_a_remote_judge_rewards_each_sample_with_its_pointwise_score(tmp_path, sft_checkpoint, monkeypatch):
    from slurm_align.judge.remote import RemoteJudge

    monkeypatch.setenv("MY_JUDGE_KEY", "sk-test-4242")
    server = subprocess.Popen([sys.executable, str(REPO / "tests" / "programs" / "openai_judge_server.py"),
                               "--log", str(tmp_path / "received.jsonl")], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "JUDGE_TEST_KEY": "sk-test-4242"})
    try:
        line = server.stdout.readline()
        assert line.startswith("PORT "), line
        remote = {"url": f"http://127.0.0.1:{int(line.split()[1])}/v1", "model": "judge",
                  "api_key_env": "MY_JUDGE_KEY"}
        run = judge_run(sft_checkpoint, {"remote": remote})
        assert run.components == ("actor",)   # served elsewhere: no component
        local = load_profile("local")
        launch(tmp_path, run, profile=local.model_copy(update={"secret_env": ["MY_JUDGE_KEY"]}))
        prompts, responses, reward = samples(tmp_path / "run", run)
        mine = JudgeReward(RemoteJudge(run.judge.remote), JudgeTemplate.get("pointwise_compact"), ["sorted"])
        expect = WEIGHT * mine.scores(prompts, responses)
    finally:
        server.kill()
        server.wait(timeout=10)
    assert np.ptp(expect) > 0
    np.testing.assert_allclose(reward, expect, rtol=0, atol=1e-5)
    assert "sk-test-4242" not in (tmp_path / "received.jsonl").read_text()


@pytest.mark.parametrize("judge, field", [({}, "reward.judge_weight"),
                                          ({"model": JUDGE_MODEL, "template": "pairwise"}, "judge.template")])
def test_a_judge_reward_without_a_judge_or_with_a_pairwise_template_is_refused(judge, field, tmp_path):
    base = EXAMPLES / "grpo_tiny.yaml"
    data = apply_overrides(read_yaml(base), ONE_STEP, str(base))
    data["judge"] = judge
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        validate(RunConfig, data, "judge_run")
