"""Multi-turn rollouts end to end: GRPO with the calculator tool on the local profile (real actor
ranks, real tool pool, real store), and the loop's pieces on their own.

One run serves the end-to-end tests: two steps with the calculator, then the environment's own
step raises in step 3. Its store must hold steps 1 and 2 whole (every trajectory with its loss
mask and turn boundaries, the tool's tokens masked), and the run must fail naming the
environment and the data row. Its reward is a partial one a random tiny policy earns
(`printable_share`): the exact answer it never writes would tie every group at 0, leave every
advantage 0, and so could not show that the tool's tokens get none.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from slurm_align import REPO_ROOT
from slurm_align.algorithms import conversations as mt
from slurm_align.algorithms.advantages import gae, kl_penalized_rewards
from slurm_align.algorithms.rollout_batch import RolloutBatch
from slurm_align.analysis.breakdown import compute_breakdown
from slurm_align.config import load_profile, load_run_config
from slurm_align.environments.base import EnvironmentContext, Messages, Row, StepResult
from slurm_align.environments.render import TurnRenderer
from slurm_align.environments.tool_calls import ToolCall
from slurm_align.environments.tool_env import ToolEnvironment
from slurm_align.models.tokenizer import ByteTokenizer
from slurm_align.profiling import phases as P
from slurm_align.store.rollouts import RolloutStore
from slurm_align.store.traces import read_traces

ARITH = REPO_ROOT / "examples" / "arithmetic"
ENV = "tests.integration.test_multiturn:CalculatorFirst"
RULE = "slurm_align.rewards.arithmetic:exact_answer"
PARTIAL = "tests.integration.test_multiturn:printable_share"


def printable_share(response: str, prompt: str, **_fields) -> float:
    """A partial reward for the final answer that a random tiny policy earns: the share of its
    characters that are printable ASCII (random bytes decode to some, and to replacement
    characters), different for nearly every sample, so GRPO's group advantages are nonzero."""
    return sum(" " <= c <= "~" for c in response) / max(len(response), 1)


class CalculatorFirst(ToolEnvironment):
    """The tool environment with the calculator, which also answers the model's FIRST turn with a
    calculator call of the row's expression (a random tiny policy never writes a call itself), so
    every trajectory has a tool turn between two model turns. With options.fail_after_resets N,
    step raises for a conversation started after this rank's N-th reset (a broken environment)."""

    name = "calculator_first"

    def __init__(self, ctx: EnvironmentContext):
        super().__init__(ctx)
        self.resets, self.fail_after = 0, ctx.settings.options.get("fail_after_resets")

    def reset(self, row: Row) -> Messages:
        self.resets += 1
        return [{"role": "user", "content": str(row["prompt"]), "n": self.resets}]

    def step_batch(self, items):
        for messages, row in items:
            if self.fail_after is not None and messages[0]["n"] > self.fail_after:
                raise KeyError(f"calculator lost row {row['prompt']!r}")
        first = [sum(m["role"] == "assistant" for m in msgs) == 1 for msgs, _ in items]
        rest = super().step_batch([it for it, f in zip(items, first) if not f]) if not all(first) else []
        calls = [ToolCall("calculator", {"expression": row["prompt"].rstrip("=")})
                 for (_, row), f in zip(items, first) if f]
        outs = iter(self.runner.run_all([self._job(c) for c in calls]))
        rest = iter(rest)
        return [StepResult([{"role": "tool", "name": "calculator", "content": next(outs).text}],
                           metrics={"tool_calls": 1.0}) if f else next(rest) for f in first]


def check_message(m: dict) -> dict:
    return {k: v for k, v in m.items() if k in ("role", "content", "name")}


# -- one shared run ----------------------------------------------------------------------------
def calculator_config(*overrides: str):
    return load_run_config(REPO_ROOT / "examples" / "grpo_tiny.yaml", [
        f"data.train_path={ARITH / 'prompts.jsonl'}", f"eval.val_path={ARITH / 'prompts_val.jsonl'}",
        "model.max_seq_len=64", f"reward.rule={PARTIAL}", "ppo.num_steps=3", "ppo.num_rollout_samples=4",
        "ppo.global_batch_size=8", "rl.n_samples_per_prompt=2", "generation.max_new_tokens=6",
        "generation.prompt_batch_size=2", "ppo.train_micro_batch_size=8", "switches.dynamic_prompts=false",
        "eval.interval=2", "eval.num_prompts=4", f"environment.environment={ENV}", "environment.tools=[calculator]",
        "environment.max_turns=3", "environment.max_total_tokens=56", *overrides])


def local_profile(*overrides: str):
    local = load_profile("local", list(overrides))   # the environment class is this module: importable in the run
    return local.model_copy(update={"env": {**local.env, "PYTHONPATH": str(REPO_ROOT)}})


@pytest.fixture(scope="module")
def calculator_run(tmp_path_factory) -> Path:
    from tests.integration.test_grpo import launch
    tmp = tmp_path_factory.mktemp("multiturn")
    # per rank: 2 eval rows (step 0), 4 conversations per step, 2 eval rows after step 2
    run = calculator_config("environment.options={fail_after_resets: 12}")
    launch(tmp, run, profile=local_profile(), expect="FAILED")
    return tmp / "run"


def test_multiturn_grpo_stores_whole_trajectories(calculator_run):
    store = RolloutStore.open(calculator_run / "rollouts.zarr", read_only=True)
    # Step 3's failure left nothing behind. Rank 0 writes the store in the background, and the
    # failing rank's MPI abort can end it before step 2's write lands (timing): whole steps only.
    steps = store.steps.tolist()
    assert steps in ([1], [1, 2]), steps
    tok = ByteTokenizer()
    for step in steps:
        d = store.read(step)
        assert len(d["reward"]) == 8
        # the model's tokens carry advantages (the groups' partial rewards differ), so the zeros
        # asserted on the tool's tokens below are the loss mask's doing
        assert (d["advantages"][d["loss_mask"] > 0] != 0).mean() > 0.5, d["reward"]
        po, ro = d["prompt_offsets"], d["response_offsets"]
        for i in range(8):
            prompt = tok.decode(d["prompt_tokens"][po[i]:po[i + 1]])
            resp = d["response_tokens"][ro[i]:ro[i + 1]]
            mask, turn, role = (d[k][ro[i]:ro[i + 1]] for k in ("loss_mask", "turn", "role"))
            # turn boundaries: model turn 0, the calculator's turn 1, then the model again
            starts = np.flatnonzero(np.diff(np.concatenate([[-1], turn])))
            assert turn[0] == 0 and (np.diff(turn) >= 0).all() and turn.max() >= 2, turn
            kinds = [int(role[s]) for s in starts]
            assert kinds[:3] == [mt.ROLE_CODES["model"], mt.ROLE_CODES["tool"], mt.ROLE_CODES["model"]]
            np.testing.assert_array_equal(mask, (role == mt.ROLE_CODES["model"]).astype(np.float32))
            tool_text = tok.decode(resp[role == mt.ROLE_CODES["tool"]])
            a, op, b = prompt.rstrip("=").replace("-", " - ").replace("+", " + ").split()
            value = int(a) + int(b) if op == "+" else int(a) - int(b)
            assert f"<tool_response>\n{value}\n</tool_response>" in tool_text
            # nothing trained on the tool's tokens: zero advantage, pi_old stored only for the model's
            assert (d["advantages"][ro[i]:ro[i + 1]][mask == 0] == 0).all()
            # the reward is the rule's on the model's last turn
            last = tok.decode(resp[turn == turn.max()])
            assert d["reward"][i] == pytest.approx(printable_share(last, prompt, answer=str(value)), abs=1e-6)


def test_multiturn_metrics_tools_phase_and_eval(calculator_run):
    lines = [json.loads(x) for x in (calculator_run / "metrics.jsonl").read_text().splitlines()]
    by_step = {m["step"]: m for m in lines}
    assert set(by_step) == {0, 1, 2}
    assert by_step[0]["val/tool_calls"] >= 1.0 and "val/score" in by_step[2]
    for s in (1, 2):
        m = by_step[s]
        assert m["train_rollouts/tool_calls"] >= 1.0 and m["train_rollouts/turns"] >= 2.0
        assert m["timers/tools"] > 0
    # response_lengths counts the model's tokens only: at most 3 turns x 6 tokens
    store = RolloutStore.open(calculator_run / "rollouts.zarr", read_only=True)
    d = store.read(1)
    model_tokens = d["loss_mask"].sum() / 8
    assert by_step[1]["train_rollouts/response_lengths"] == pytest.approx(model_tokens, rel=1e-5)
    assert model_tokens < np.diff(d["response_offsets"]).mean()
    # `analyze breakdown` shows the tools' time as its own phase
    b = compute_breakdown(read_traces(calculator_run / "traces.zarr").spans)
    assert P.TOOLS in b.phases and b.mean_phase_s[b.phases.index(P.TOOLS)] > 0


def test_environment_step_error_stops_the_run_naming_env_and_row(calculator_run):
    logs = "".join(p.read_text() for p in (calculator_run / "logs" / "actor").glob("rank*.log"))
    assert f"environment {ENV!r}: step raised KeyError" in logs
    assert "calculator lost row" in logs and "(data row {" in logs


def test_a_usr2_stop_then_resume_keeps_every_trajectory_whole(tmp_path):
    """Multi-turn GRPO stopped by USR2 after step 1 and resumed: the store holds steps 1 and 2
    once each, step 1 as it was before the resume, and both equal an uninterrupted run of the
    same config, field by field (tokens, loss mask, turns, roles, rewards, advantages): no
    trajectory cut, lost or redone."""
    from tests.integration.test_grpo import launch
    from tests.support.preempt_support import stop_by_usr2_after_the_first_step

    run = calculator_config("ppo.num_steps=2", "eval.interval=0", "actor.data_parallel=1")
    profile = local_profile("components.actor.tasks_per_node=1")
    launch(tmp_path, run, profile=profile, name="reference")
    stop_by_usr2_after_the_first_step(run, profile, tmp_path / "run")
    read = lambda name: RolloutStore.open(tmp_path / name / "rollouts.zarr", read_only=True)  # noqa: E731
    before = read("run").read(1)
    launch(tmp_path, run, profile=profile, name="run")   # the resume: the stock actor
    assert "resuming from step 2" in (tmp_path / "run" / "logs" / "actor" / "rank0.log").read_text()
    mine, ref = read("run"), read("reference")
    assert mine.steps.tolist() == ref.steps.tolist() == [1, 2]
    for step in (1, 2):
        got, want = mine.read(step), ref.read(step)
        assert got.keys() == want.keys() and (got["role"] == mt.ROLE_CODES["tool"]).any()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"step {step} {name}")
            if step == 1:
                np.testing.assert_array_equal(got[name], before[name], err_msg=f"step 1 {name} rewritten")


# -- the loop's pieces, without a run ----------------------------------------------------------
def test_stop_cut_and_plain_rendering():
    tok = ByteTokenizer()
    text = 'x<tool_call>{"name": "c"}</tool_call>tail'
    n = mt.stop_cut(tok, tok.encode(text), ["</tool_call>"])
    assert tok.decode(tok.encode(text)[:n]) == 'x<tool_call>{"name": "c"}</tool_call>'
    assert mt.stop_cut(tok, tok.encode("no stop"), ["</tool_call>"]) is None
    r = TurnRenderer(tok, None)
    reply = [{"role": "tool", "name": "calculator", "content": "42"}]
    assert tok.decode(r.reply([{"role": "assistant", "content": "x"}], reply, chat=False)) == \
        "\n<tool_response>\n42\n</tool_response>\n"


def test_masked_tokens_are_skipped_by_gae_and_the_score_lands_on_the_last_model_token():
    # a model turn (2 tokens), the tool's (2), the model's answer (1), padding (1)
    mask = torch.tensor([[1., 1., 0., 0., 1., 0.]])
    values = torch.tensor([[0.5, 0.4, 9.0, 9.0, 0.2, 0.0]])
    r = kl_penalized_rewards(torch.tensor([1.0]), torch.zeros(1, 6), torch.zeros(1, 6), mask, 0.0)
    assert r.tolist() == [[0, 0, 0, 0, 1.0, 0]]
    adv, _ = gae(r, values, mask, gamma=1.0, lam=1.0)
    alone_adv, _ = gae(r[:, [0, 1, 4]], values[:, [0, 1, 4]], torch.ones(1, 3), 1.0, 1.0)
    torch.testing.assert_close(adv[:, [0, 1, 4]], alone_adv)
    assert adv[0, 2:4].tolist() == [0, 0] and adv[0, 5] == 0
    b = RolloutBatch.from_sequences([[1, 2]], [[3, 4, 5, 6, 7, 8]], 0)
    b.set_tokens("loss_mask", mask)
    assert b.mask.tolist() == mask.tolist()
    assert b.position_mask()[0].tolist() == [0, 1, 1, 0, 0, 1, 0, 0]


def ppo_calculator_config(*overrides: str):
    return load_run_config(REPO_ROOT / "examples" / "ppo_tiny.yaml", [
        f"data.train_path={ARITH / 'prompts.jsonl'}", "model.max_seq_len=64", "critic_model.max_seq_len=64",
        "reward.model=false", f"reward.rule={RULE}", "ppo.num_steps=1", "ppo.num_rollout_samples=8",
        "generation.max_new_tokens=6", "generation.prompt_batch_size=4", f"environment.environment={ENV}",
        "environment.tools=[calculator]", "environment.max_turns=3", *overrides])


def check_one_step_of_trajectories(run_dir: Path, critic: bool) -> None:
    """One step stored and logged: tool calls were made, the loss mask is the model's tokens, the
    environment's tokens carry no advantage (nor return, with a critic) while the model's have
    some (GRPO's from the partial reward's differences inside a group); with a critic, a finite
    value loss."""
    [m] = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "timers/step" in x]
    assert m["train_rollouts/tool_calls"] >= 1.0
    assert ("train_optim/critic_loss" in m) == critic and (not critic or np.isfinite(m["train_optim/critic_loss"]))
    d = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True).read(1)
    env_tokens = d["loss_mask"] == 0
    assert env_tokens.any() and (d["advantages"][env_tokens] == 0).all()
    np.testing.assert_array_equal(d["loss_mask"], (d["role"] == mt.ROLE_CODES["model"]).astype(np.float32))
    assert (d["advantages"][~env_tokens] != 0).any()
    assert not critic or (d["returns"][env_tokens] == 0).all()


@pytest.mark.slurm
@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_multiturn_as_a_slurm_job(slurm_cluster, tmp_path, algorithm):
    """On the Slurm cluster: PPO (value model in the critic component) as a hetjob, the critic's
    value loss and GAE seeing the same masked trajectories; GRPO as a plain job. One step is
    enough to show each path works (GRPO's multi-step run is on the local profile above)."""
    from tests.integration.test_grpo import launch
    if algorithm == "ppo":
        run, components = ppo_calculator_config(), ["actor", "critic"]
    else:
        run, components = calculator_config("ppo.num_steps=1", "eval.interval=0"), ["actor"]
    slurm = load_profile("local-slurm")
    launch(tmp_path, run, profile=slurm.model_copy(update={"env": {**slurm.env, "PYTHONPATH": str(REPO_ROOT)}}))
    assert json.loads((tmp_path / "run" / "job.json").read_text())["components"] == components
    assert ("hetjob" in (tmp_path / "run" / "job.sbatch").read_text()) == (algorithm == "ppo")
    check_one_step_of_trajectories(tmp_path / "run", critic=algorithm == "ppo")


@pytest.mark.parametrize("trainer_tp", [1, 2], ids=["trainer_tp1", "trainer_tp2"])
def test_multiturn_ppo_with_the_critic_and_a_generator_on_the_local_profile(tmp_path, trainer_tp):
    """Multi-turn PPO with disaggregated rollouts: the generator component runs the conversations
    (its tool pool, its environment) and streams whole trajectories (loss mask, turns, roles) to
    the actor, which sends them on to the critic; the trainer may be TP 2 (only generation
    replicas of several ranks are refused for multi-turn). (Colocated multi-turn PPO: the Slurm test.)"""
    from tests.integration.test_grpo import launch
    launch(tmp_path, ppo_calculator_config(f"actor.tensor_parallel={trainer_tp}", "actor.data_parallel=1",
                                           "rollout.mode=disaggregated"),
           profile=local_profile(f"components.actor.tasks_per_node={trainer_tp}"))
    assert json.loads((tmp_path / "run" / "job.json").read_text())["components"] == ["actor", "critic", "generator"]
    check_one_step_of_trajectories(tmp_path / "run", critic=True)
    spans = read_traces(tmp_path / "run" / "traces.zarr").spans
    assert P.TOOLS in set(spans[spans["component"] == "generator"]["phase"].tolist())   # the tools ran there
