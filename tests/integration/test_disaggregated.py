"""Disaggregated rollouts (rollout.mode 'disaggregated'): a generator component beside the actor,
rollouts streamed to the actor, weights streamed back, staleness bounded by
rollout.max_off_policy_steps.

Four tiny end-to-end runs on the local profile, shared by the tests below: colocated (one actor
rank), and disaggregated with k=0 (one actor rank, TP 1 -> generator), k=1 (actor TP 2 ->
generator) and k=2 with a fixed lag (actor PP 2 -> generator), all at the same seed with static
prompt shards. They start from the session's SFT policy with the sort task's partial reward, so
every step trains (a random init never ends a response nor earns a reward: its weights would never
change, and a generator that never applied new weights would pass every test here);
`test_every_shared_run_trains_at_every_step` guards that.
"""

from __future__ import annotations

import itertools
import json
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from slurm_align.algorithms.generator import WEIGHT_DIGESTS
from slurm_align.config import ClusterProfile, RunConfig, load_profile
from slurm_align.config.errors import ConfigError
from slurm_align.generation.stream import StreamAuthError, StreamServer, connect
from slurm_align.generation.weight_stream import WeightAssembler, buckets, send_weights
from slurm_align.store.rollouts import RolloutStore
from tests.integration.test_generation_trtllm import GPU_REASON, GPUS, HAVE_TRTLLM
from tests.integration.test_grpo import grpo_config, launch, metrics

STEPS = {"colocated": 2, "k0": 2, "k1": 3, "k2": 4}
SMALL = ["switches.dynamic_prompts=false", "eval.interval=0", "ppo.num_rollout_samples=4", "ppo.global_batch_size=16",
         "rl.n_samples_per_prompt=4", "ppo.train_micro_batch_size=4"]
# The partial reward (up to 0.5 for the right digits in order, 1 for the exact sort) varies inside
# nearly every group of the SFT policy's samples, so GRPO's advantages and the gradients are
# nonzero at every step (a group whose samples all get one reward teaches nothing, and under the
# exact reward all-wrong groups are common).
TRAINS = ["reward.rule=slurm_align.rewards.sort:partial"]
DISAGGREGATED = ["rollout.mode=disaggregated", "rollout.record_weight_digests=true",
                 "rollout.weight_bucket_mb=0.1"]   # several buckets per version


def run_configs(sft: Path) -> dict[str, tuple[RunConfig, int]]:
    """Each shared run's config (from the SFT policy `sft`) and its number of actor ranks."""
    one = ["actor.data_parallel=1"]   # the fewest processes: each costs seconds of start-up on 2 cores
    small = [*SMALL, *TRAINS, f"model.init_checkpoint={sft}"]
    return {
        "colocated": (grpo_config(*small, *one, f"ppo.num_steps={STEPS['colocated']}"), 1),
        "k0": (grpo_config(*small, *one, *DISAGGREGATED, "rollout.max_off_policy_steps=0",
                           f"ppo.num_steps={STEPS['k0']}"), 1),
        "k1": (grpo_config(*small, *DISAGGREGATED, "rollout.max_off_policy_steps=1",
                           f"ppo.num_steps={STEPS['k1']}", "actor.tensor_parallel=2", "actor.data_parallel=1",
                           "rollout.weight_transport=collective"), 2),
        "k2": (grpo_config(*small, *DISAGGREGATED, "rollout.max_off_policy_steps=2", "rollout.lag=fixed",
                           f"ppo.num_steps={STEPS['k2']}", "actor.pipeline_parallel=2", "actor.data_parallel=1"), 2),
    }


def actor_ranks(n: int) -> ClusterProfile:
    return load_profile("local", [f"components.actor.tasks_per_node={n}"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sft_checkpoint) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("disaggregated")
    configs = run_configs(sft_checkpoint)
    for name, (run, ranks) in configs.items():
        launch(root, run, profile=actor_ranks(ranks), name=name)
    return {name: root / name for name in configs}


def store(run_dir: Path) -> dict[int, dict[str, np.ndarray]]:
    s = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True)
    return {step: s.read(step) for step in s.steps.tolist()}


def digests(run_dir: Path, side: str) -> list[dict]:
    """The weight-digest records of one side of the stream (rollout.record_weight_digests)."""
    return [json.loads(line) for line in (run_dir / WEIGHT_DIGESTS[side]).read_text().splitlines()]


def training_rows(run_dir: Path) -> list[dict]:
    return [m for m in metrics(run_dir) if "timers/step" in m]


@pytest.mark.parametrize("name", list(STEPS))
def test_every_shared_run_trains_at_every_step(runs, name):
    """The guard of the tests below: every step's gradient is nonzero, and every weight version
    the trainer sent differs from the one before (else a generator that applied nothing, or
    applied a version late, would be caught by none of them)."""
    rows = training_rows(runs[name])
    assert [m["step"] for m in rows] == list(range(1, STEPS[name] + 1))
    assert all(m["train_optim/grad_norm"] > 0 for m in rows), [m["train_optim/grad_norm"] for m in rows]
    if name != "colocated":
        sent = sorted(digests(runs[name], "trainer"), key=lambda r: r["version"])
        for before, after in itertools.pairwise(sent):
            changed = [k for k in after["sha256"] if after["sha256"][k] != before["sha256"][k]]
            assert len(changed) > len(after["sha256"]) // 2, (after["version"], changed)


def test_k0_gives_the_colocated_rollouts_and_metrics(runs):
    col, dis = store(runs["colocated"]), store(runs["k0"])
    assert list(col) == list(dis) == [1, 2]
    for step in col:
        for name, want in col[step].items():
            if name == "rank":    # who generated: the actor's ranks vs the generator's rank 0
                continue
            got = dis[step][name]
            if want.dtype.kind == "f":
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=name)
            else:
                np.testing.assert_array_equal(got, want, err_msg=name)
        assert (dis[step]["version"] == step - 1).all()   # on-policy: the newest weights every step
    for want, got in zip(training_rows(runs["colocated"]), training_rows(runs["k0"]), strict=True):
        for key, value in want.items():
            if not key.startswith("timers/"):
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert got["train_rollouts/dropped_stale"] == 0 and got["train_rollouts/max_staleness"] == 0
        if got["step"] < STEPS["k0"]:   # no sync after the last step
            assert got["weight_sync/bytes"] > 0 and got["weight_sync/seconds"] > 0 and got["timers/weight_sync"] > 0


@pytest.mark.parametrize("name,k", [("k1", 1), ("k2", 2)])
def test_never_trains_on_a_sample_older_than_k_versions(runs, name, k):
    data, rows = store(runs[name]), training_rows(runs[name])
    assert list(data) == list(range(1, STEPS[name] + 1))
    seen = []
    for (step, d), m in zip(data.items(), rows, strict=True):
        staleness = (step - 1) - d["version"]
        assert (staleness >= 0).all() and (staleness <= k).all(), (step, d["version"])
        assert len(set(d["version"].tolist())) == 1      # weights change between steps, never inside one
        assert m["train_rollouts/max_staleness"] == staleness.max() and m["train_rollouts/dropped_stale"] == 0
        seen.append(int(d["version"][0]))
    assert seen == sorted(seen) and seen[0] == 0         # versions only advance
    if name == "k2":   # rollout.lag fixed: step s gets version s - 1 - k exactly
        assert seen == [max(step - 1 - k, 0) for step in data], seen


# trainer TP 1, TP 2 and PP 2 -> generator TP 1; k1's weights go over a gloo group, the others' in the stream
@pytest.mark.parametrize("name", ["k0", "k1", "k2"])
def test_generator_weights_equal_the_trainers_after_each_sync(runs, name):
    log = (runs[name] / "logs" / "generator" / "rank0.log").read_text()
    assert ("weights: gloo group with the trainer" in log) == (name == "k1")
    sent = {r["version"]: r["sha256"] for r in digests(runs[name], "trainer")}
    applied = digests(runs[name], "generator")
    assert sorted(sent) == list(range(STEPS[name]))      # the initial weights and one version per step but the last
    if name == "k0":
        assert [r["version"] for r in applied] == list(range(STEPS[name]))   # k=0 applies every version
    for r in applied:
        assert r["sha256"] == sent[r["version"]], r["version"]


def test_a_usr2_stop_then_resume_trains_each_sample_once_as_the_uninterrupted_run(runs, tmp_path, sft_checkpoint):
    """USR2 to the job script once step 1 is done (the actor holds there until the stop request
    came, tests/programs/preempt_hold_actor.py, so the run cannot finish first): the actor saves, the
    generator stops with it, the job ends STOPPED. The resumed run's generator regenerates step 2
    from the checkpoint's weights with the same per-sample seeds (nothing of the generator's is
    checkpointed), so with k=0 the store, the metrics and the final actor checkpoint equal the
    uninterrupted k0 run's: no sample trained twice, none lost."""
    from tests.support.preempt_support import assert_same_final_actor_checkpoint, stop_by_usr2_after_the_first_step

    run, ranks = run_configs(sft_checkpoint)["k0"]
    run_dir = tmp_path / "run"
    stop_by_usr2_after_the_first_step(run, actor_ranks(ranks), run_dir)
    assert list(store(run_dir)) == [1]
    log = run_dir / "logs" / "actor" / "rank0.log"
    launch(tmp_path, run, profile=actor_ranks(ranks), name="run")   # the resume: the stock actor
    assert "resuming from step 2" in log.read_text()
    mine, ref = store(run_dir), store(runs["k0"])
    assert list(mine) == list(ref) == [1, 2]
    for step in ref:
        for name, want in ref[step].items():
            np.testing.assert_array_equal(mine[step][name], want, err_msg=f"step {step} {name}")
    assert [m["step"] for m in training_rows(run_dir)] == [m["step"] for m in training_rows(runs["k0"])]
    assert_same_final_actor_checkpoint(run_dir, runs["k0"], tmp_path)
    # the resumed generator generated step 2 with the very weights the uninterrupted trainer sent
    applied, sent = digests(run_dir, "generator"), digests(runs["k0"], "trainer")
    assert applied[-1]["version"] == 1 and applied[-1]["sha256"] == next(r for r in sent if r["version"] == 1)["sha256"]


# -- the parts, without a run ------------------------------------------------------------------
def _pair(secret_server: str, secret_client: str):
    server = StreamServer("127.0.0.1", secret_server)
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("s", server.accept(timeout=5)), daemon=True)
    t.start()
    return server, got, t, lambda: connect("127.0.0.1", server.port, secret_client, timeout=5)


def test_the_stream_refuses_a_peer_without_the_secret_and_serves_one_with_it():
    server, got, t, dial = _pair("s" * 32, "x" * 32)
    with pytest.raises(StreamAuthError):
        dial()
    good = connect("127.0.0.1", server.port, "s" * 32, timeout=5)
    t.join(5)
    assert server.refused == 1 and "s" in got
    good.send("ping", {"n": 1}, {"a": torch.arange(3)})
    msg = got["s"].recv(timeout=5)
    assert msg.kind == "ping" and msg.meta == {"n": 1} and torch.equal(msg.tensors["a"], torch.arange(3))
    good.close()
    server.close()


def test_the_stream_refuses_every_interface():
    with pytest.raises(ValueError, match="every interface"):
        StreamServer("0.0.0.0", "s" * 32)


def test_weights_arrive_whole_in_buckets_and_out_of_order_is_refused():
    sd = {"decoder.layers.0.a": torch.randn(100, 10), "decoder.layers.1.b": torch.randn(7),
          "decoder.layers.1.c": torch.randn(300), "output_layer.weight": torch.arange(5)}
    # bytes: layer 0 4000 (alone: above the limit), layer 1 28 + 1200 = 1228, + 40 would pass 1250
    assert buckets(sd, 1250) == [["decoder.layers.0.a"], ["decoder.layers.1.b", "decoder.layers.1.c"],
                                 ["output_layer.weight"]]
    server, got, t, dial = _pair("s" * 32, "s" * 32)
    client = dial()
    t.join(5)
    send_weights(client, sd, 4, 1250)
    msgs = [got["s"].recv(timeout=5) for _ in range(3)]
    asm = WeightAssembler()
    assert asm.feed(msgs[0]) is None and asm.feed(msgs[1]) is None   # nothing applied before the last bucket
    version, whole = asm.feed(msgs[2])
    assert version == 4 and sorted(whole) == sorted(sd) and all(torch.equal(whole[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match="out of order"):
        WeightAssembler().feed(msgs[1])
    client.close()
    server.close()


@pytest.mark.parametrize("overrides,match", [
    (["generator.tensor_parallel=2"], "generator.tensor_parallel=2 with generation.engine='torch'"),
    (["generator.pipeline_parallel=2"], "generator.pipeline_parallel=2"),
    (["generation.engine=trtllm", "rollout.record_weight_digests=true"], "record_weight_digests"),
    (["generation.engine=vllm", "rollout.record_weight_digests=true"], "record_weight_digests.*'vllm'"),
    (["generation.engine=vllm", "generator.tensor_parallel=3"],
     "generator.tensor_parallel=3 with generation.engine='vllm': it must divide num_attention_heads"),
    (["rollout.max_off_policy_steps=-1"], "max_off_policy_steps"),
    (["rollout.bind_host=0.0.0.0"], "every interface"),
])
def test_bad_disaggregated_settings_are_refused_with_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        grpo_config("rollout.mode=disaggregated", *overrides)


@pytest.mark.mpi
def test_generator_ranks_form_tensor_parallel_replicas_for_tensorrt_llm():
    """Four generator ranks at generator.tensor_parallel 2: two replicas of consecutive ranks, a
    TensorRT-LLM engine per pair on the ranks' GPUs, and the collector's samples each once, from
    the requesters (tests/programs/generator_replica_prog.py)."""
    from tests.integration.test_balance import mpirun
    proc = mpirun(4, "tests.programs.generator_replica_prog", timeout=300)
    assert proc.returncode == 0 and "GENERATOR_REPLICAS_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    per_rank = json.loads(proc.stdout.splitlines()[0])["per_rank"]   # the split between replicas is work-stealing's
    assert per_rank[1] == per_rank[3] == 0 and sum(per_rank) == 24, per_rank


def test_tensorrt_llm_in_the_generator_is_checked_against_the_generators_gpus():
    """TensorRT-LLM runs in the generator: at submit its GPUs are checked, not the actor's (a CPU
    generator is refused; a TP replica larger than a node is refused, naming the generator)."""
    from slurm_align.config.loading import check_runnable, trtllm_tp_fits_a_node
    trt = ["rollout.mode=disaggregated", "generation.engine=trtllm"]
    with pytest.raises(ConfigError, match="gives the generator gpus_per_node=0"):
        check_runnable(grpo_config(*trt, "eval.interval=0"),
                       load_profile("local", ["components.actor.gpus_per_node=2"]))
    gpu = load_profile("example-gpu-cluster")   # the generator: 2 nodes x 8 GPUs

    def run(tp: int) -> RunConfig:
        return grpo_config(*trt, "model.num_attention_heads=16", "model.hidden_size=256", "eval.interval=0",
                           f"generator.tensor_parallel={tp}", f"generator.data_parallel={16 // tp}")
    assert trtllm_tp_fits_a_node(run(8), gpu) == []
    (problem,) = trtllm_tp_fits_a_node(run(16), gpu)
    assert "field 'generator.tensor_parallel': got 16" in problem and "tensor_parallel <= 8" in problem


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(not (HAVE_TRTLLM and GPUS), reason=GPU_REASON)
def test_tensorrt_llm_generates_in_the_generator_component(tmp_path):
    """GRPO as actor + generator on one GPU (local profile), TensorRT-LLM in the generator, k=0:
    its engine is refitted from the stream every step, every sample is of version step - 1, and
    the engine's log-probs are the trainer's up to bf16 (rollout correction's k3 KL, weights ~1)."""
    run = grpo_config(*SMALL, "actor.data_parallel=1", "rollout.mode=disaggregated", "generation.engine=trtllm",
                      "rollout.max_off_policy_steps=0", "rollout_correction.mode=token_truncate", "ppo.num_steps=3",
                      "model.position_embedding=rope", "model.normalization=RMSNorm", "model.activation=swiglu",
                      "model.add_bias_linear=false")
    gpu = ["gpus_per_node=1", "tasks_per_node=1"]
    launch(tmp_path, run, profile=load_profile("local", [f"components.{c}.{x}" for c in ("actor", "generator")
                                                         for x in gpu]))
    data, rows = store(tmp_path / "run"), training_rows(tmp_path / "run")
    assert list(data) == [1, 2, 3] and all((d["version"] == step - 1).all() for step, d in data.items())
    assert [m["weight_sync/bytes"] > 0 for m in rows[:-1]] == [True, True]
    for m in rows:
        kl, w = m["train_rollouts/rollout_correction_kl_k3"], m["train_rollouts/rollout_correction_weight_mean"]
        assert 0 <= kl < 0.02 and abs(w - 1) < 0.05, m


def test_the_run_declares_a_generator_component_with_its_resources():
    run = grpo_config("rollout.mode=disaggregated")
    assert run.components == ("actor", "generator")
    assert load_profile("local").resources("generator").ranks == run.generator.world_size
    assert grpo_config().components == ("actor",)


@pytest.mark.slurm
def test_a_killed_generator_rank_fails_the_three_component_hetjob_naming_it(slurm_cluster, tmp_path):
    """A real heterogeneous job of three components on the local Slurm cluster, PPO's actor and
    critic and a generator of two ranks: kill -9 of generator rank 1 once a step is done fails
    the job within a bound (without the failure handling the actor would wait on the stream, or
    run its 50 steps, far past it), and `status` names the generator and the rank."""
    from slurm_align.slurm.launch import launch_run
    from tests.integration.test_failures import rank_process
    from tests.integration.test_ppo import tiny_run
    from tests.support.preempt_support import cli, logs_text, wait_for

    run = tiny_run("rollout.mode=disaggregated", "ppo.num_steps=50", "generator.data_parallel=2",
                   "actor.data_parallel=1", "switches.dynamic_prompts=false")
    profile = load_profile("local-slurm", ["components.actor.nodes=1", "components.generator.tasks_per_node=2"])
    job = launch_run(run, profile, tmp_path / "run")
    assert json.loads((tmp_path / "run" / "job.json").read_text())["components"] == ["actor", "critic", "generator"]
    assert "hetjob" in (tmp_path / "run" / "job.sbatch").read_text()
    m = tmp_path / "run" / "metrics.jsonl"
    wait_for(lambda: m.exists() and m.read_text(), "a first step", timeout=600, job=job)
    rank_process(tmp_path / "run", "generator", 1).send_signal(signal.SIGKILL)
    assert job.wait(timeout_s=180, poll_s=0.2) == "FAILED", logs_text(tmp_path / "run")
    status = json.loads(cli("status", str(tmp_path / "run"), "--json", timeout=60).stdout)
    failed = (status["state"], status["failed"]["component"], status["failed"]["rank"])
    assert failed == ("FAILED", "generator", 1), status


def test_the_trainer_zeroes_samples_older_than_k_and_counts_them():
    from slurm_align.algorithms.generator import stale_mask
    from slurm_align.algorithms.rollout_batch import RolloutBatch
    b = RolloutBatch.from_sequences([[1, 2]] * 4, [[3], [4, 5], [6], [7]], pad_id=0, version=[0, 1, 2, 3])
    b.set_samples("train", torch.tensor([1.0, 1.0, 0.0, 1.0]))
    got = stale_mask(grpo_config("rollout.mode=disaggregated", "rollout.max_off_policy_steps=1"), b, step=4,
                     dp_group=None)   # the trainer holds version 3: staleness 3, 2, 1, 0
    assert b["train"].tolist() == [0.0, 0.0, 0.0, 1.0]   # the group filter's 0 stays 0
    assert got == {"dropped_stale": 2.0, "max_staleness": 3.0}
