"""GRPO, RLOO, rejection sampling and PPO mini-batches end to end: real actor ranks (and a real
reward-only critic when a reward model scores), on the local profile and as real Slurm jobs.

The learning tests measure the task itself (held-out exact sort accuracy of greedy answers, per
prompt: RUN_DIR/eval/step_<N>.jsonl), not the reward, and a run with the advantage sign flipped
must fail the same check; they decide with exact sign tests (tests/support/learning.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from slurm_align import REPO_ROOT
from slurm_align.analysis.significance import paired_counts, pooled_correct
from slurm_align.config import load_profile, load_run_config
from slurm_align.config.errors import ConfigError
from slurm_align.models.tokenizer import ByteTokenizer
from slurm_align.profiling import phases as P
from slurm_align.rewards import sort
from slurm_align.slurm.launch import launch_run
from slurm_align.slurm.render import Entry
from slurm_align.store.rollouts import RolloutStore
from slurm_align.store.traces import read_traces
from tests.support import learning
from tests.support.critic_support import run_child

EXAMPLES = REPO_ROOT / "examples"
SYNTH = EXAMPLES / "synthetic"


def grpo_config(*overrides: str):
    return load_run_config(EXAMPLES / "grpo_tiny.yaml", [
        f"data.train_path={SYNTH / 'prompts.jsonl'}", f"eval.val_path={SYNTH / 'prompts_val.jsonl'}",
        "ppo.num_steps=2", "ppo.num_rollout_samples=8", "ppo.global_batch_size=16", "rl.n_samples_per_prompt=4",
        "generation.max_new_tokens=8", "generation.prompt_batch_size=2", "ppo.train_micro_batch_size=8",
        "eval.interval=2", "eval.num_prompts=16", *overrides])


def launch(tmp_path: Path, run, profile="local", name: str = "run", entry: Entry = Entry(),
           expect: str = "COMPLETED"):
    profile = load_profile(profile) if isinstance(profile, str) else profile
    job = launch_run(run, profile, tmp_path / name, entry=entry)
    state = job.wait(timeout_s=900)
    if state != expect:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for ps in job.failed_logs().values() for p in ps)
        pytest.fail(f"{run.algorithm} job ended {state}, expected {expect}\n{logs}")
    return job


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def val_score(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["val/score"] for m in metrics(run_dir) if "val/score" in m}


def check_rollouts(run_dir: Path, steps: list[int], samples: int, group: int) -> None:
    """Every stored step is whole: its rewards are the rule's, its groups hold `group` samples of
    one prompt each, and the group advantages of GRPO sum to ~0 per group. (Runs without a KL
    term: the reference pass was skipped, its log-probs are NaN.)"""
    store = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True)
    assert store.steps.tolist() == steps
    tok = ByteTokenizer()
    for step in steps:
        d = store.read(step)
        assert len(d["reward"]) == samples
        po, ro = d["prompt_offsets"], d["response_offsets"]
        prompts = [tok.decode(d["prompt_tokens"][po[i]:po[i + 1]]) for i in range(samples)]
        responses = [tok.decode(d["response_tokens"][ro[i]:ro[i + 1]]) for i in range(samples)]
        assert [sort.exact(r, p) for r, p in zip(responses, prompts)] == d["reward"].tolist()
        # samples are stored in index order: index i * group + j belongs to prompt slot i
        for g in range(samples // group):
            assert len(set(prompts[g * group:(g + 1) * group])) == 1
        first_token_adv = np.array([d["advantages"][ro[i]] if ro[i + 1] > ro[i] else 0.0 for i in range(samples)])
        assert np.isfinite(d["advantages"]).all()
        assert np.isnan(d["ref_logprobs"]).all()
        assert np.abs(first_token_adv.reshape(-1, group).sum(1)).max() < 1e-3


# --- configuration ----------------------------------------------------------------------------
def test_job_shape_follows_the_algorithm():
    assert grpo_config().components == ("actor",)                      # rule reward only: one component
    assert grpo_config("reward.model=true").components == ("actor", "critic")
    assert grpo_config("reward.rule=null", "eval.interval=0").components == ("actor", "critic")  # RM alone
    assert not grpo_config("reward.model=true").critic_trains           # reward-only critic
    assert grpo_config("algorithm=rloo").advantage_estimator == "rloo"
    assert not grpo_config().kl_in_reward and grpo_config("algorithm=reinforce_pp").kl_in_reward
    # the reference log-prob pass runs only for a KL term (the runs below show it in their spans)
    assert not grpo_config().uses_reference and grpo_config("rl.kl_loss_coef=0.1").uses_reference
    assert grpo_config("algorithm=reinforce_pp").uses_reference
    assert not grpo_config("algorithm=reinforce_pp", "ppo.kl_coef=0").uses_reference


@pytest.mark.parametrize("overrides,match", [
    (["rl.n_samples_per_prompt=1"], "rl.n_samples_per_prompt=1: grpo compares"),
    (["ppo.global_batch_size=12"], "ppo.global_batch_size=12 must divide the step's rollouts"),
    (["reward.rule=no spaces allowed"], "reward.rule"),
    (["reward.rule=null", "reward.model=false"], "neither a reward model"),
    (["eval.val_path=null"], "eval.interval=2 needs eval.val_path"),
    (["rl.loss_agg=seq-sum"], "rl.loss_agg"),
])
def test_bad_settings_are_refused_with_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        grpo_config(*overrides)


# --- one component on the local profile, and the same as a real plain Slurm job ----------------
def check_single_component_run(run_dir: Path, filtered: bool = False) -> None:
    assert json.loads((run_dir / "job.json").read_text())["components"] == ["actor"]
    assert not (run_dir / "logs" / "critic").exists()
    check_rollouts(run_dir, steps=[1, 2], samples=32, group=4)
    records = metrics(run_dir)
    assert [m["step"] for m in records] == [0, 1, 2]          # step 0: the initial policy's evaluation
    assert set(val_score(run_dir)) == {0, 2}
    assert all(0.0 <= v <= 1.0 for v in val_score(run_dir).values())
    store = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True)
    tied = []
    for m in records[1:]:
        assert {"train_rollouts/rewards", "train_optim/loss", "train_optim/ppo_ratio",
                "train_optim/optimizer_steps"} <= set(m) and "train_optim/critic_loss" not in m
        assert "train_rollouts/kl" not in m                 # no KL term: no reference pass
        assert m["train_optim/optimizer_steps"] == 2        # 32 rollouts in global batches of 16
        if filtered:   # dynamic sampling: the groups of 4 whose rewards are all equal are dropped
            rewards = store.read(m["step"])["reward"].reshape(8, 4)   # stored in index order: group i = rows 4i..4i+3
            tied.append(int((rewards.min(1) == rewards.max(1)).sum()))
            assert m["train_rollouts/dropped_groups"] == tied[-1], (m["step"], rewards)
            assert m["train_rollouts/dropped_group_fraction"] == tied[-1] / 8
            assert (m["train_optim/grad_norm"] > 0) == (tied[-1] < 8), m   # a step trains iff it kept a group
    if filtered:   # the run shows both outcomes of the filter (from the SFT policy some groups tie, some not)
        assert 0 < sum(tied) < 8 * len(tied), tied
    table = read_traces(run_dir / "traces.zarr", {"actor": 2})
    assert table.complete, table.problems()
    assert {P.GENERATE, P.LOGPROBS, P.TRAIN} <= set(table.spans["phase"].tolist())
    assert P.INIT_LOGPROBS not in set(table.spans["phase"].tolist())   # skipped: nothing reads it


@pytest.mark.slurm
def test_grpo_single_component_as_plain_slurm_job(slurm_cluster, tmp_path, sft_checkpoint):
    """One component, no critic: a plain (not het) Slurm job; the equal-reward filter on, from the
    session's SFT policy, whose groups sometimes all tie and sometimes not (from a random init
    every group ties at 0 and is dropped: a filter that dropped nothing, or everything, would
    pass). (The local profile runs GRPO in the rule-error and learning tests.)"""
    launch(tmp_path, grpo_config("rl.filter_equal_reward_groups=true", f"model.init_checkpoint={sft_checkpoint}"),
           profile="local-slurm")
    assert "hetjob" not in (tmp_path / "run" / "job.sbatch").read_text()
    check_single_component_run(tmp_path / "run", filtered=True)


@pytest.mark.slurm
def test_grpo_with_reward_model_as_hetjob(slurm_cluster, tmp_path):
    """Rule + reward model: the critic component serves the reward model only (no value model,
    no critic training); the reward is model_weight x RM score + rule_weight x rule. With a KL loss
    term the reference log-prob pass runs (without one it is skipped: the run above)."""
    run = grpo_config("reward.model=true", "reward.model_weight=0.5", "reward.rule_weight=2.0",
                      "rl.kl_loss_coef=0.05", "critic_server.connect_timeout_s=300")
    launch(tmp_path, run, profile="local-slurm")
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / "job.json").read_text())["components"] == ["actor", "critic"]
    table = read_traces(run_dir / "traces.zarr", {"actor": 2, "critic": 1})
    critic = set(table.spans[table.spans["component"] == "critic"]["phase"].tolist())
    assert P.CRITIC_INFER in critic and P.CRITIC_TRAIN not in critic
    ref = table.spans[(table.spans["component"] == "actor") & (table.spans["phase"] == P.INIT_LOGPROBS)]
    assert sorted(set(zip(ref["rank"].tolist(), ref["step"].tolist()))) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all("train_rollouts/kl" in m for m in metrics(run_dir)[1:])
    assert not list((run_dir / "checkpoints").glob("critic/*"))       # nothing trained, nothing saved
    store = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True)
    d = store.read(1)
    assert np.isfinite(d["ref_logprobs"]).all() and (d["ref_logprobs"] <= 0).all()
    tok = ByteTokenizer()
    po, ro = d["prompt_offsets"], d["response_offsets"]
    rule = np.array([sort.exact(tok.decode(d["response_tokens"][ro[i]:ro[i + 1]]),
                                tok.decode(d["prompt_tokens"][po[i]:po[i + 1]])) for i in range(len(d["reward"]))])
    # The reward model's own scores of the same sequences (prompt + response, as the actor sends
    # them), computed apart from the run: the stored reward is 0.5 x those + 2.0 x the rule's.
    n = len(d["reward"])
    seqs = [np.concatenate([d["prompt_tokens"][po[i]:po[i + 1]], d["response_tokens"][ro[i]:ro[i + 1]]])
            for i in range(n)]
    lengths = np.array([len(q) for q in seqs], np.int64)
    tokens = np.full((n, lengths.max()), ByteTokenizer.pad_id, np.int64)   # right padding: causal, inert
    for i, q in enumerate(seqs):
        tokens[i, :len(q)] = q
    np.savez(tmp_path / "seqs.npz", tokens=tokens, lengths=lengths)
    run_child("reward-scores", str(run_dir), str(tmp_path / "seqs.npz"), str(tmp_path / "scores.npz"))
    rm = np.load(tmp_path / "scores.npz")["scores"]
    assert np.ptp(rm) > 0                                                # a real, varying RM score
    np.testing.assert_allclose(d["reward"], 0.5 * rm + 2.0 * rule, rtol=0, atol=1e-4)


# --- rule reward errors -----------------------------------------------------------------------
CALLS = {"n": 0}


def exact_then_broken(response, prompt, **fields):
    """The sort reward for the first 32 samples this process scores, then an error (a rank
    generates at most 32 of a step's 32 samples, so step 1 always completes)."""
    CALLS["n"] += 1
    if CALLS["n"] > 32:
        raise ValueError("the checker lost its answer key")
    return sort.exact(response, prompt)


def test_rule_reward_error_stops_the_run_and_keeps_earlier_steps(tmp_path):
    run = grpo_config("ppo.num_steps=4", "reward.rule=tests.integration.test_grpo:exact_then_broken", "eval.interval=0")
    local = load_profile("local")   # jobs run in their run directory: make this module importable there
    profile = local.model_copy(update={"env": {**local.env, "PYTHONPATH": str(REPO_ROOT)}})
    job = launch(tmp_path, run, profile=profile, expect="FAILED")
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs" / "actor").glob("rank*.log"))
    assert ("rule reward tests.integration.test_grpo:exact_then_broken raised ValueError: "
            "the checker lost its answer key") in logs
    assert "(prompt '" in logs
    store = RolloutStore.open(tmp_path / "run" / "rollouts.zarr", read_only=True)
    kept = store.steps.tolist()
    assert kept in ([1], [1, 2]), kept                    # the failing step left nothing behind
    check_rollouts(tmp_path / "run", steps=kept, samples=32, group=4)
    assert job.state() == "FAILED"


@pytest.fixture
def weak_sft(sft_checkpoint) -> Path:
    """An SFT policy that sorts some held-out prompts exactly (greedy), leaving room to learn
    (the session's shared SFT run, tests/conftest.py)."""
    return sft_checkpoint


# --- learning on the task ---------------------------------------------------------------------
# Each learning test decides with paired exact sign tests on 2,000 held-out prompts
# (tests/support/learning.py): the run's end beats its start and its broken twin's end, and the
# twin does not beat its start. Not a margin on one trajectory: another CPU's float path
# (AVX2 against AVX-512 kernels) changes the trajectory, not the verdict
# (benchmarks/learning_spread.py measures it under several).
def learning_config(sft: Path, *overrides: str, example: str = "grpo_tiny.yaml"):
    return load_run_config(EXAMPLES / example, [
        f"data.train_path={SYNTH / 'prompts.jsonl'}", f"eval.val_path={SYNTH / 'prompts_val.jsonl'}",
        f"model.init_checkpoint={sft}", *LEARN, *overrides])


# Static prompt sharding: each rank trains on the same samples whatever the machine's speed, so a
# learning run gives the same scores every time on one machine (work stealing would reorder the
# batches). One actor rank: a second one adds nothing these tests look at (the DP paths are
# tested by the short runs above) and costs a rank's imports and a core. Evaluated every 10
# steps: the end point pools steps 20, 30 and 40 (2,000 greedy prompts take about a second).
# 40 steps, not 60: measured under ATEN_CPU_CAPABILITY default, avx2 and this host's avx512
# (60-step runs; a shorter run is their exact prefix, no schedule depends on num_steps), the
# pooled end at 40 steps beat the start at p <= 2e-9 in every test (reinforce_pp, avx2), at 30
# steps only at p = 1e-3 (the async example, avx2); the shared GRPO run (grpo_learning_run) and
# the async example's comparison with it run the same 40.
LEARN = ["switches.dynamic_prompts=false", "actor.data_parallel=1", "ppo.num_steps=40", "ppo.num_rollout_samples=32",
         "rl.n_samples_per_prompt=8", "ppo.global_batch_size=128", "ppo.actor_lr=5e-4", "eval.interval=10"]
ONE_ACTOR_RANK = ["components.actor.tasks_per_node=1"]


def launch_learning(run_dir: Path, run, entry: Entry = Entry()) -> Path:
    """A learning run (learning_config) on one actor rank of the local profile; its run directory."""
    launch(run_dir.parent, run, profile=load_profile("local", ONE_ACTOR_RANK), name=run_dir.name, entry=entry)
    return run_dir


def accuracy_gain(run_dir: Path) -> float:
    scores = val_score(run_dir)
    return scores[max(scores)] - scores[0]


GRPO_FAMILY = pytest.mark.skipif(os.environ.get("SLURM_ALIGN_GRPO_FAMILY") != "1",
                                 reason="a learning claim of GRPO's family: set SLURM_ALIGN_GRPO_FAMILY=1")
"""The learning claims of GRPO's relatives (RLOO, REINFORCE++ in fp32 and bf16, rejection sampling,
GRPO with LoRA, the asynchronous example) are opt-in: each is a 40-60-step run and its twin (34-55
CPU-s each, 227 CPU-s together in the suite: ~2 min of a 2-core host's wall). The suite keeps GRPO's own
claim (the shared run) and PPO's; what the relatives change is tested in the suite without a
learning run: each estimator and rejection sampling's selection on fixed batches
(tests/unit/algorithms/test_advantages.py, test_policy_gradient.py, test_policy_update.py), LoRA
training only the adapters and GRPO's actor with LoRA (integration/test_lora.py), the generator
component's rollouts and correction (test_disaggregated.py, test_rollout_correction.py), bf16
steps (test_optimizer.py)."""
BROKEN_ACTOR = Path(__file__).parents[1] / "programs" / "grpo_flipped_actor.py"
BROKEN_STEPS = ["ppo.num_steps=10", "eval.interval=2"]
"""The broken twin runs 10 steps, evaluated every 2 (its end pools steps 6, 8 and 10): enough to
show it does not rise. Measured from the 0.268 start (2,000 prompts, under three float paths):
every flipped-sign twin ends at 0.000 (536 prompts right -> wrong, none wrong -> right), the
worst-sample rejection-sampling twin at 0.034 (15 wrong -> right, 483 right -> wrong)."""


# Each algorithm against its own broken twin (tests/programs/grpo_flipped_actor.py): the advantage's sign
# flipped (GRPO, RLOO, REINFORCE++), the worst sample of each group kept (rejection sampling).
@pytest.mark.slow
@pytest.mark.timeout(1500)   # two or more end-to-end runs: a hang guard sized for a loaded 2-core machine
@pytest.mark.parametrize("algorithm,overrides", [
    ("grpo", []),
    # RLOO at GRPO's lr overshoots here (measured, 200 prompts held out, every 20 steps: 5e-4
    # peaks at step 40, 0.28 -> 0.35, and ends at 0.295; 2.5e-4 rises every time, 0.33, 0.36, 0.37).
    pytest.param("rloo", ["ppo.actor_lr=2.5e-4"], marks=GRPO_FAMILY),
    # REINFORCE++ in fp32 and in bf16 (issue 36: bf16 weights and activations, fp32 main weights
    # and gradients, models/optimizer.py); the algorithm's math does not depend on the precision.
    pytest.param("reinforce_pp", [], marks=GRPO_FAMILY),
    pytest.param("rejection_sampling", ["ppo.num_steps=20", "eval.interval=5"], marks=GRPO_FAMILY),
    # LoRA adapters only (base frozen, reference = adapters off, merged refit): a higher rate,
    # and 60 steps (its end pools 40, 50, 60): at that rate it wanders over the first 40 (measured,
    # pooled end at step 40 under the no-AVX path: 0.305, p = 2e-6; at step 60 under the native,
    # AVX2 and no-AVX paths: 0.334-0.337, p <= 4e-16).
    pytest.param("grpo", ["model.lora.rank=8", "model.lora.alpha=16", "ppo.actor_lr=2e-3", "ppo.num_steps=60"],
                 marks=GRPO_FAMILY),
    pytest.param("reinforce_pp", ["training.precision=bf16"], marks=GRPO_FAMILY),
], ids=["grpo", "rloo", "reinforce_pp", "rejection_sampling", "grpo_lora", "reinforce_pp_bf16"])
def test_raises_heldout_accuracy_and_its_broken_twin_does_not(request, tmp_path, weak_sft, algorithm, overrides):
    if algorithm == "grpo" and not overrides:   # the session's shared run (the async example compares with it)
        good_dir = request.getfixturevalue("grpo_learning_run")
    else:
        good_dir = launch_learning(tmp_path / "good", learning_config(weak_sft, f"algorithm={algorithm}", *overrides))
    broken_dir = launch_learning(tmp_path / "broken",
                                 learning_config(weak_sft, f"algorithm={algorithm}", *overrides, *BROKEN_STEPS),
                                 entry=Entry(scripts={"actor": BROKEN_ACTOR}))
    name = request.node.callspec.id
    verdict = learning.verdict(name, good_dir, broken_dir)
    print(verdict)
    verdict.check()


ASYNC_SLACK = 0.05
"""Issue 22's bar: the asynchronous example ends at least at grpo_tiny's held-out accuracy minus 5
points (both pooled over their last evaluations, on the same 2,000 prompts: its sampling error
is about 1 point)."""


@GRPO_FAMILY
@pytest.mark.slow
@pytest.mark.timeout(1500)   # two end-to-end runs (and the shared GRPO one): a hang guard for a loaded 2-core machine
def test_async_example_learns_as_grpo_tiny_does_and_its_broken_twin_does_not(tmp_path, weak_sft, grpo_learning_run):
    """examples/grpo_async_tiny.yaml (a generator component, one step off, rollout correction)
    against grpo_tiny at the same samples (40 steps of 256 rollouts each), held-out exact accuracy
    from the same SFT policy. Its rollout.lag 'fixed' makes its samples the same every run (with
    'newest' the version a step gets depends on timing), so the scores are too."""
    good_dir = launch_learning(tmp_path / "async", learning_config(weak_sft, example="grpo_async_tiny.yaml"))
    broken_dir = launch_learning(tmp_path / "broken",
                                 learning_config(weak_sft, *BROKEN_STEPS, example="grpo_async_tiny.yaml"),
                                 entry=Entry(scripts={"actor": BROKEN_ACTOR}))
    assert max(m["train_rollouts/max_staleness"] for m in metrics(good_dir) if "timers/step" in m) == 1
    verdict = learning.verdict("grpo_async", good_dir, broken_dir)
    # ... and as grpo_tiny does: the prompts where the two ends differ, paired
    sync = paired_counts(pooled_correct(grpo_learning_run, learning.end_steps(grpo_learning_run)),
                         pooled_correct(good_dir, verdict.end))
    verdict = dataclasses.replace(verdict, versus=sync)
    print(verdict)
    verdict.check()
    assert sync.c - sync.b <= ASYNC_SLACK * sync.n, \
        f"the async example ended {sync.c - sync.b} prompts below grpo_tiny " \
        f"(at most {ASYNC_SLACK * sync.n:.0f}): {sync}"
