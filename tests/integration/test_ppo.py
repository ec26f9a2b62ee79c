"""PPO end to end: real actor and critic components, on the local profile and as a real hetjob."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.data.jsonl import PROMPT_KEYS, read_jsonl
from slurm_align.models.tokenizer import ByteTokenizer
from slurm_align.profiling import phases as P
from slurm_align.slurm.launch import launch_run
from slurm_align.slurm.render import Entry
from slurm_align.store.rollouts import RolloutStore
from slurm_align.store.traces import read_traces
from tests.support import learning
from tests.support.preempt_support import STEPS, assert_same_final_state, assert_unchanged, snapshot

FLIPPED_PPO_ACTOR = Path(__file__).parents[1] / "programs" / "ppo_flipped_actor.py"
EXAMPLE = REPO_ROOT / "examples" / "ppo_tiny.yaml"
PROMPTS = REPO_ROOT / "examples" / "synthetic" / "prompts.jsonl"
ACTOR_PHASES = {P.REFIT, P.GENERATE, P.LOGPROBS, P.INIT_LOGPROBS, P.CRITIC_WAIT, P.REBALANCE, P.STORE, P.TRAIN}


def tiny_run(*overrides: str):
    return load_run_config(EXAMPLE, [
        f"data.train_path={PROMPTS}", "ppo.num_steps=2", "ppo.num_rollout_samples=8",
        "generation.max_new_tokens=8", "generation.prompt_batch_size=2", "ppo.train_micro_batch_size=2",
        # critic_server.port stays 0: the critic binds a free port and publishes the address
        "critic_server.connect_timeout_s=120", *overrides])


def run_ppo(tmp_path: Path, profile: str, *overrides: str, name: str = "run", entry: Entry = Entry()) -> Path:
    run_dir = tmp_path / name
    job = launch_run(tiny_run(*overrides), load_profile(profile), run_dir, entry=entry)
    state = job.wait(timeout_s=600)
    if state != "COMPLETED":
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for ps in job.failed_logs().values() for p in ps)
        pytest.fail(f"PPO job ended {state}\n{logs}")
    return run_dir


def check_complete_run(run_dir: Path, steps: int, samples: int, actor_ranks: int, max_new_tokens: int = 8) -> None:
    store = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True)
    assert store.steps.tolist() == list(range(1, steps + 1))     # steps count from 1
    prompts = {tuple(ByteTokenizer().encode(r["prompt"])) for r in read_jsonl(PROMPTS, PROMPT_KEYS, "prompts")}
    for step in range(1, steps + 1):
        data = store.read(step)
        assert len(data["reward"]) == samples          # no sample lost or duplicated
        n_tokens = int(data["response_offsets"][-1])
        for name in ("logprobs", "ref_logprobs", "values", "advantages", "returns"):
            assert data[name].shape == (n_tokens,), name
            assert np.isfinite(data[name]).all(), name
        assert np.array_equal(np.diff(data["response_offsets"]), data["length"])
        assert (data["length"] >= 1).all() and (data["length"] <= max_new_tokens).all()
        assert set(np.unique(data["rank"]).tolist()) <= set(range(actor_ranks))
        assert (data["logprobs"] <= 0).all()
        po = data["prompt_offsets"]
        for i in range(samples):   # every stored prompt is BOS + a prompt of the data set
            toks = data["prompt_tokens"][po[i]:po[i + 1]]
            assert toks[0] == ByteTokenizer.bos_id and tuple(toks[1:].tolist()) in prompts
    table = read_traces(run_dir / "traces.zarr", {"actor": actor_ranks, "critic": 1})
    assert table.complete, table.problems()
    spans = table.spans
    for r in range(actor_ranks):
        mine = spans[(spans["component"] == "actor") & (spans["rank"] == r)]
        assert set(mine["phase"].tolist()) >= ACTOR_PHASES
        assert set(mine["step"].tolist()) == set(range(1, steps + 1))
    critic = spans[spans["component"] == "critic"]
    assert {P.CRITIC_INFER, P.CRITIC_TRAIN} <= set(critic["phase"].tolist())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in metrics if "timers/step" in m]   # training steps (step 0 holds only val/score)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:   # NeMo-Aligner's metric names
        assert {"train_rollouts/rewards", "train_rollouts/kl", "train_rollouts/fraction_of_samples_properly_ended",
                "train_optim/loss", "train_optim/ppo_ratio", "train_optim/grad_norm", "train_optim/critic_loss",
                "timers/generate", "timers/train", "timers/step"} <= set(m)
        assert m["timers/generate"] > 0 and m["timers/step"] >= m["timers/train"]


@pytest.mark.timeout(1500)   # may wait for the shared reference run: sized for a loaded machine
def test_ppo_on_local_profile(ppo_reference):
    """The session's reference run (tiny_run with static prompts, 4 steps, a checkpoint after
    each, tests/conftest.py) is a whole local-profile PPO run: asserted here instead of a run of
    its own. Dynamic prompts (work stealing over two DP ranks) are checked the same way on the
    Slurm job of test_submit's single-allocation test."""
    run_dir = ppo_reference()
    check_complete_run(run_dir, steps=STEPS, samples=8, actor_ranks=2)
    for step in range(1, STEPS + 1):
        assert (run_dir / "checkpoints" / "actor" / f"iter_{step:07d}" / "manifest.json").is_file()


@pytest.fixture(scope="module")
def tp2_split_run(tmp_path_factory, sft_checkpoint) -> Path:
    """One run for two tests: the actor at TP=2, and each step's 8 rollouts trained in global
    batches of 2. From the weak SFT policy (the session's, tests/conftest.py): PPO's loss counts
    only responses that ended, which a random init rarely does."""
    return run_ppo(tmp_path_factory.mktemp("tp2-split"), "local", "actor.tensor_parallel=2", "actor.data_parallel=1",
                   "ppo.global_batch_size=2", "ppo.actor_lr=1e-2", "ppo.train_micro_batch_size=1",
                   f"model.init_checkpoint={sft_checkpoint}")


def test_ppo_with_tensor_parallel_2(tp2_split_run):
    check_complete_run(tp2_split_run, steps=2, samples=8, actor_ranks=2)
    # One generation replica spans both TP ranks: only its first rank asks for prompts.
    store = RolloutStore.open(tp2_split_run / "rollouts.zarr", read_only=True)
    assert set(store.read(1)["rank"].tolist()) == {0}


def test_ppo_global_batches_move_the_ratio_and_clip(tp2_split_run):
    """8 rollouts in global batches of 2: the later optimizer steps see a policy that already
    moved, so the ratio leaves 1 and the clip acts. With one global batch it cannot: that
    control is asserted on PPO's learning run
    (test_ppo_raises_its_reward_with_every_switch_off_and_a_flipped_advantage_does_not)."""
    lines = (tp2_split_run / "metrics.jsonl").read_text().splitlines()
    updates = [m for m in map(json.loads, lines) if "train_optim/optimizer_steps" in m]
    assert updates
    for split in updates:
        assert split["train_optim/optimizer_steps"] == 4
        assert split["train_optim/ppo_ratio_clamped"] > 0.0
        assert abs(split["train_optim/ppo_ratio"] - 1.0) > 1e-3


def test_ppo_with_pipeline_parallel_2_refolded_for_generation(tmp_path):
    # Static prompt shards make the split between the generation ranks deterministic.
    run_dir = run_ppo(tmp_path, "local", "actor.pipeline_parallel=2", "actor.data_parallel=1",
                      "switches.refold=true", "switches.dynamic_prompts=false")
    check_complete_run(run_dir, steps=2, samples=8, actor_ranks=2)
    # Refold in effect: both pipeline stages generated (DP_gen = 2) half of the prompts each; the
    # training shard (DP = 1) still held all 8 samples (check_complete_run counts them).
    store = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True)
    for step in (1, 2):
        assert np.bincount(store.read(step)["rank"], minlength=2).tolist() == [4, 4]


@pytest.mark.timeout(1500)   # the reference run may be waited for as well: sized for a loaded machine
def test_resume_goes_on_from_the_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path, ppo_reference):
    """A crash after step 2's rollouts were stored but before its checkpoint committed (its folder
    is gone): the run resumed with more steps says "resuming from step 2", leaves step 1's rollouts
    and spans byte-unchanged (a restart from step 1 would rewrite them), redoes step 2 once, and
    ends with the very rollouts, metrics and final actor/critic state of the uninterrupted 4-step
    reference (an actor that took the step number but not the checkpoint's weights would not: the
    reference starts from the SFT policy and trains at every step, assert_same_final_state checks)."""
    run_dir = tmp_path / "run"
    job = launch_run(tiny_run(*ppo_reference.overrides, "ppo.num_steps=2"), load_profile("local"), run_dir)
    assert job.wait(timeout_s=600) == "COMPLETED", job.failed_logs()
    shutil.rmtree(run_dir / "checkpoints" / "actor" / "iter_0000002")
    # (the critic saved step 2 first, as before a real crash of the actor's write: it is not used)
    before = snapshot(run_dir, 1)
    job = launch_run(tiny_run(*ppo_reference.overrides), load_profile("local"), run_dir)
    assert job.wait(timeout_s=600) == "COMPLETED", job.failed_logs()
    log = (run_dir / "logs" / "actor" / "rank0.log").read_text()
    assert "resuming from step 2 " in log, log[-3000:]
    assert_unchanged(before, snapshot(run_dir, 1))
    table = read_traces(run_dir / "traces.zarr", {"actor": 2, "critic": 1})
    actor0 = table.spans[(table.spans["component"] == "actor") & (table.spans["rank"] == 0)]
    refits = actor0[actor0["phase"] == P.REFIT]
    assert sorted(refits["step"].tolist()) == [1, 2, 3, 4]   # spans of the redone step are not doubled
    assert_same_final_state(run_dir, ppo_reference(), tmp_path)   # store steps, metrics, weights


# --- learning -------------------------------------------------------------------------------
EXAMPLES = REPO_ROOT / "examples"
SYNTH = EXAMPLES / "synthetic"


@pytest.fixture
def sft_and_rm(sft_checkpoint, rm_checkpoint):
    """An SFT policy that has partly learnt the task and a reward model (session runs, conftest)."""
    return sft_checkpoint, rm_checkpoint


LEARN_STEPS = 30
REWARD_WINDOW = 10
"""PPO's reward is decided on the per-sample rewards of its first and last REWARD_WINDOW steps
(320 samples each; tests/support/learning.py, a one-sided rank-sum test at p < 1e-3). A step's
mean reward swings by 2 with the 5-point exact-sort term, so short windows are weak. Measured on
one rank under four float paths (benchmarks/learning_spread.py): 15 steps in windows of 3,
p = 0.04 (this host); 30 steps in windows of 5, p = 8e-7 to 6e-4 (the AVX2 path: too close);
in windows of 10, p = 3e-9 to 5e-8. The suite's run (EVERY_SWITCH_OFF below: two actor ranks at
PP=2, the naive engine) in windows of 10: p = 6.0e-6 (an AVX-512 host's native path), 4.5e-8
(avx2), 4.8e-20 (default), its flipped twin's fall p = 1.0 under all three."""
TWIN_STEPS, TWIN_WINDOW = 10, 5
"""The flipped twin's run and its windows: its reward falls by several points within a few steps."""


def learning_run(sft: Path, rm: Path, steps: int = LEARN_STEPS) -> list[str]:
    # Held-out task score (the independent scorer, exact sort, greedy) of the initial and the final
    # policy: the reward model's own reward can be gamed, the task's score cannot. As in the main
    # job (examples/ppo_tiny.sh), the reward model is combined with the task's verifiable reward:
    # on the reward model alone PPO games it and the held-out accuracy falls (measured: -0.234).
    return [f"model.init_checkpoint={sft}", f"critic_model.init_checkpoint={rm}", f"ppo.num_steps={steps}",
            "reward.model=true", "reward.rule=slurm_align.rewards.sort:exact", "reward.rule_weight=5.0",
            "ppo.kl_coef=0.05", "switches.dynamic_prompts=false",
            "ppo.num_rollout_samples=32", "generation.max_new_tokens=12", "generation.prompt_batch_size=4",
            "ppo.train_micro_batch_size=8", "ppo.actor_lr=1e-3", f"eval.val_path={SYNTH / 'prompts_val.jsonl'}",
            "eval.scorer=slurm_align.rewards.sort:exact", f"eval.interval={steps}", "eval.num_prompts=200"]


def val_gain(run_dir: Path, steps: int) -> float:
    """Held-out exact-sort accuracy after the last step minus that of the initial policy."""
    scores = {m["step"]: m["val/score"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if "val/score" in m}
    assert sorted(scores) == [0, steps], scores
    return scores[steps] - scores[0]


def launch_learning(run_dir: Path, overrides: list[str], entry: Entry = Entry()) -> Path:
    """A learning run on ONE actor rank (a second adds nothing the learning test looks at)."""
    job = launch_run(tiny_run(*overrides, "actor.data_parallel=1"),
                     load_profile("local", ["components.actor.tasks_per_node=1"]), run_dir, entry=entry)
    state = job.wait(timeout_s=900)
    if state != "COMPLETED":
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for ps in job.failed_logs().values() for p in ps)
        pytest.fail(f"PPO learning run {run_dir.name} ended {state}\n{logs}")
    return run_dir


EVERY_SWITCH_OFF = [*(f"switches.{s}=false" for s in ("kv_cache_engine", "dynamic_prompts", "async_critic", "refold",
                                                       "offload_optimizer")),
                    "actor.pipeline_parallel=2", "actor.data_parallel=1"]
"""Naive engine, static sharding, synchronous critic, no refold (PP=2: two actor ranks), no offload.
Each switch on is shown elsewhere to change when work happens, never what is computed (the
reference run's equality tests above, test_generation_training's KV-cache engine against the
naive one, the PP=2 refold test above), so PPO learning with every switch off stands for it
learning with them on, and this file runs one PPO learning run, not two."""


@pytest.mark.slow
@pytest.mark.timeout(1500)   # two or more end-to-end runs: a hang guard sized for a loaded 2-core machine
def test_ppo_raises_its_reward_with_every_switch_off_and_a_flipped_advantage_does_not(tmp_path, sft_and_rm):
    """PPO with every switch off (EVERY_SWITCH_OFF) runs whole (every step, sample, span and
    metric) and raises the reward it optimises (reward model + exact-sort rule), and the same run
    with the advantage sign flipped does not (tests/support/learning.py's reward verdict). It does
    NOT show task learning: the held-out exact accuracy is printed, not asserted, because from the
    weak 50-step SFT it falls (measured -0.188 in 15 steps with the rule reward, -0.234 on the
    reward model alone); the main job's longer run from the 150-step SFT is where PPO's held-out
    score is shown (examples/ppo_tiny.sh)."""
    learn = learning_run(*sft_and_rm)
    good_dir = run_ppo(tmp_path, "local", *learn, *EVERY_SWITCH_OFF, name="good")
    check_complete_run(good_dir, steps=LEARN_STEPS, samples=32, actor_ranks=2, max_new_tokens=12)
    # One global batch (the default: all of a step's rollouts) and one epoch: the only optimizer
    # step starts from the policy that generated, so the ratio is 1 and the clip never acts (the
    # control of test_ppo_global_batches_move_the_ratio_and_clip).
    updates = [m for m in map(json.loads, (good_dir / "metrics.jsonl").read_text().splitlines())
               if "train_optim/optimizer_steps" in m]   # (none in the critic's warm-up steps)
    assert updates
    for m in updates:
        assert m["train_optim/optimizer_steps"] == 1 and m["train_optim/ppo_ratio_clamped"] == 0.0, m
        assert abs(m["train_optim/ppo_ratio"] - 1.0) < 1e-4, m
    # The same run with the advantage sign flipped (tests/programs/ppo_flipped_actor.py) must not learn.
    flipped_dir = run_ppo(tmp_path, "local", *learning_run(*sft_and_rm, steps=TWIN_STEPS), *EVERY_SWITCH_OFF,
                          name="flipped", entry=Entry(scripts={"actor": FLIPPED_PPO_ACTOR}))
    verdict = learning.reward_verdict("ppo", good_dir, LEARN_STEPS, REWARD_WINDOW, flipped_dir, TWIN_STEPS, TWIN_WINDOW)
    print(f"{verdict}\n  held-out accuracy gain {val_gain(good_dir, LEARN_STEPS):+.3f} "
          f"(flipped {val_gain(flipped_dir, TWIN_STEPS):+.3f}): printed, not asserted")
    verdict.check()


@pytest.mark.timeout(1500)   # waits for the shared reference run too: sized for a loaded machine
def test_async_critic_and_offload_do_not_change_results(tmp_path, ppo_reference):
    """With static prompts, a run with the critic called synchronously and the optimizer kept on
    device (both switches off) ends as the reference with both on: the same rollouts, metrics
    steps and final actor/critic state (they change when work happens, never what is computed)."""
    off = ["switches.async_critic=false", "switches.offload_optimizer=false"]
    run_dir = run_ppo(tmp_path, "local", *ppo_reference.overrides, *off)
    assert_same_final_state(run_dir, ppo_reference(), tmp_path)


@pytest.mark.timeout(1500)   # waits for the shared reference run too: sized for a loaded machine
def test_disaggregated_on_policy_ppo_ends_as_the_colocated_run(tmp_path, ppo_reference):
    """PPO with a generator component (rollout.mode 'disaggregated', k = 0: on-policy), the critic
    valuing and scoring the samples the generator streamed to the actor: the same rollouts,
    metrics steps and final actor and critic state as the colocated reference (a value or reward
    of the wrong sample, or a missing one, would change the advantages and so the weights)."""
    run_dir = run_ppo(tmp_path, "local", *ppo_reference.overrides, "rollout.mode=disaggregated",
                      "rollout.max_off_policy_steps=0")
    assert json.loads((run_dir / "job.json").read_text())["components"] == ["actor", "critic", "generator"]
    assert_same_final_state(run_dir, ppo_reference(), tmp_path)
    store = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True)
    for step in store.steps.tolist():
        assert (store.read(step)["version"] == step - 1).all()   # generated by the generator, newest weights
