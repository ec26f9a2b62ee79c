"""Each phase's cost against its formula worked by hand, and the combination's overlaps."""

from __future__ import annotations

import os

import pytest

from slurm_align.config import RunConfig
from slurm_align.config.profile import ClusterProfile, HardwareConfig
from slurm_align.planning.hardware import Hardware, measure_collective_latency, measure_cpu_flops, resolve
from slurm_align.planning.steptime import (
    Costs,
    ModelShape,
    Workload,
    actor_share,
    batch_generation_s,
    batch_link_s,
    collective_s,
    combine,
    critic_share,
    decode_step_s,
    forward_pass_s,
    grad_reduce_s,
    ideal_phases,
    job_cores,
    phase_times,
    predict,
    schedule,
    share,
    tp_pass_link_s,
)

# slurm-align's default GPT: 2 layers, width 64, 4 heads of 16, MLP 256 (GELU), vocab 260 padded
# to 320, 128 learned positions, untied output.
ATTN = 64 * (4 + 2 * 4) * 16 + 4 * 16 * 64          # qkv + proj = 16384
MLP = 2 * 64 * 256                                  # fc1 + fc2 = 32768
MATMUL = 2 * (ATTN + MLP) + 64 * 320                # + output layer = 118784
PARAMS = 2 * (ATTN + MLP) + 320 * 64 + 64 * 320 + 128 * 64   # + embedding, output, positions


def hw(flops: float = 1e9, mem: float = 1e9, intra: float = 1e8, inter: float = 1e7,
       cores: int | None = None) -> Hardware:
    return Hardware("test", {"fp32": flops, "bf16": 2 * flops, "fp16": 2 * flops}, mem, 2**30, intra, inter, cores)


def test_model_counts_are_the_architecture():
    shape = ModelShape.of(RunConfig().model)
    assert shape.matmul_params == MATMUL == 118784
    assert shape.params == PARAMS
    assert ModelShape.of(RunConfig().model, value_head=True).matmul_params == 2 * (ATTN + MLP) + 64


def test_forward_flops_are_matmuls_plus_causal_attention():
    shape = ModelShape.of(RunConfig().model)
    # 2 FLOPs per weight per token, and 4 * layers * width per (query, key) pair, L^2 / 2 pairs
    assert shape.forward_flops(10) == 2 * MATMUL * 10 + 4 * 2 * 64 * 100 / 2


def test_decode_is_bound_by_bytes_or_by_flops():
    shape = ModelShape.of(RunConfig().model)
    kv = 2 * 2 * 4 * 16 * 4   # K and V, layers, groups, head_dim, fp32 bytes per cached token
    # memory-bound: a slow memory, a fast ALU
    t = decode_step_s(shape, [10, 20], hw(flops=1e15, mem=1e9), "fp32", tp=1)
    assert t == pytest.approx((PARAMS * 4 + kv * 30) / 1e9)
    # compute-bound: the other way round; TP splits the work
    t = decode_step_s(shape, [10, 20], hw(flops=1e9, mem=1e15), "fp32", tp=2)
    flops = 2 * (2 * MATMUL) + 4 * 2 * 64 * 30
    assert t == pytest.approx(flops / 2e9)


def test_a_batch_decodes_until_its_longest_response_ended():
    shape = ModelShape.of(RunConfig().model)
    h = hw(flops=1e9, mem=1e15)   # compute-bound: every term is FLOPs / 1e9
    t = batch_generation_s(shape, [2, 3], [1, 2], h, "fp32", tp=1)
    prefill = shape.forward_flops(2) + shape.forward_flops(3)
    step0 = 2 * (2 * MATMUL) + 4 * 2 * 64 * (2 + 3)   # both decode, contexts 2 and 3
    step1 = 2 * MATMUL + 4 * 2 * 64 * 4               # only the second, context 3 + 1
    assert t == pytest.approx((prefill + step0 + step1) / 1e9)


def test_work_stealing_evens_out_long_batches_and_static_shards_do_not():
    durations = [3.0, 1.0, 1.0, 1.0]
    assert schedule(durations, 2, dynamic=True)[0] == 3.0     # r0: 3; r1: 1+1+1
    assert schedule(durations, 2, dynamic=False)[0] == 4.0    # r0: 3+1; r1: 1+1
    assert schedule(durations, 2, dynamic=True)[1] == [3.0, 1.0, 2.0, 3.0]


def test_passes_split_over_data_and_model_parallel_ranks_with_the_bubble():
    shape = ModelShape.of(RunConfig().model)
    run = RunConfig(actor={"data_parallel": 2, "pipeline_parallel": 2})
    lengths = [10] * 8
    t = forward_pass_s(shape, run.actor, lengths, hw(), "fp32", micro_batch=2, rate=1.0, passes=3.0)
    # 3 passes over half the sequences (DP 2), split over 2 stages; 4 sequences / 2 = 2 micro-batches
    assert t == pytest.approx(3 * 4 * shape.forward_flops(10) / 2 * (1 + 1 / 2) / 1e9)


def test_gradient_all_reduce_is_a_ring_over_dp():
    shape = ModelShape.of(RunConfig().model)
    run = RunConfig(actor={"data_parallel": 4, "tensor_parallel": 2})
    assert grad_reduce_s(shape, run.actor, 1e8, reductions=3) == pytest.approx(3 * 2 * 3 / 4 * PARAMS / 2 * 4 / 1e8)
    assert grad_reduce_s(shape, RunConfig().actor, 1e8, reductions=3) == 0.0


def test_ranks_on_one_shared_host_share_its_cores():
    assert share(hw(cores=2), busy_cores=4) == 0.5
    assert share(hw(cores=2), busy_cores=1) == 1.0
    assert share(hw(cores=None), busy_cores=64) == 1.0


def test_on_a_shared_host_the_actor_counts_the_jobs_cores_and_the_critic_its_own(monkeypatch):
    # the local test cluster: 4 actor ranks and 2 critic ranks (of 2 cores each) on one 2-core host
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    run = RunConfig(actor={"data_parallel": 4}, critic={"data_parallel": 2})
    prof = ClusterProfile(kind="local", hardware={"accelerator": "cpu", "shared_host": True},
                          components={"actor": {"nodes": 4, "cpus_per_task": 2},
                                      "critic": {"tasks_per_node": 2, "cpus_per_task": 2}})
    assert job_cores(run, prof) == 4 * 2 + 2 * 2
    assert actor_share(run, prof) == pytest.approx(2 / 12)
    assert critic_share(prof) == 0.5
    ideal = ideal_phases(run, prof, Workload(8, (10,), (6,)))
    alone = ideal_phases(run, prof.model_copy(update={"hardware": HardwareConfig(accelerator="cpu")}),
                         Workload(8, (10,), (6,)))
    assert ideal["logprobs"] == pytest.approx(alone["logprobs"] * 6)
    # the critic's passes at its own share: the actor's ranks sleep while they wait for them
    assert ideal["critic_infer"] == pytest.approx(alone["critic_infer"] * 2)
    assert ideal["critic_train"] == pytest.approx(alone["critic_train"] * 2)


def test_constant_phases_are_the_actors_cpu_work_at_its_share():
    costs = Costs(constant_s={"other": 0.3, "store": 0.1}, constant_share=1.0)
    assert phase_times({}, costs, share=1.0)["other"] == 0.3
    # measured with the whole core, predicted at 2 / 5 of it: 5 / 2 times as long
    got = phase_times({}, costs, share=0.4)
    assert got["other"] == pytest.approx(0.3 / 0.4) and got["store"] == pytest.approx(0.1 / 0.4)
    assert phase_times({}, Costs(constant_s={"other": 0.3}, constant_share=0.5), share=0.25)["other"] == \
        pytest.approx(0.6)


BASE = {"refit": 1.0, "generate": 10.0, "rebalance": 2.0, "logprobs": 3.0, "init_logprobs": 3.0,
        "store": 0.5, "train": 6.0}


def test_a_critic_faster_than_the_log_probs_adds_no_wait():
    # 10 engine batches: after generation the critic has one batch left, 4 / 10 = 0.4 s < 1 + 3 + 3
    step, phases, _ = combine({**BASE, "critic_infer": 4.0, "critic_train": 5.0}, engine_batches=10)
    assert phases["critic_wait"] == 0.0
    assert step == sum(BASE.values())


def test_a_slower_critic_adds_the_difference():
    # one engine batch: the critic starts after generation; 12 s against rebalance/2 + 3 + 3 = 7 s
    step, phases, crit = combine({**BASE, "critic_infer": 12.0, "critic_train": 5.0}, engine_batches=1)
    assert crit["critic_infer"] == pytest.approx(5.0)
    assert phases["critic_wait"] == pytest.approx(5.0)
    assert step == pytest.approx(sum(BASE.values()) + 5.0)
    # the critic's update slower than the actor's by 2 s: 2 s more, and the critic bounds it
    step2, phases2, crit2 = combine({**BASE, "critic_infer": 12.0, "critic_train": 8.0}, engine_batches=1)
    assert step2 == pytest.approx(step + 2.0)
    assert phases2["critic_wait"] == pytest.approx(7.0)
    assert crit2["critic_train"] == 8.0 and crit2["train"] == 0.0


def test_disaggregated_generation_overlaps_training_when_off_policy():
    t = {"generate": 10.0, "weight_sync": 1.0, "logprobs": 2.0, "train": 3.0}
    assert combine(t, engine_batches=4, disaggregated=True, max_off_policy_steps=1)[0] == 11.0
    assert combine(t, engine_batches=4, disaggregated=True, max_off_policy_steps=0)[0] == 17.0


def test_more_data_parallel_nodes_shorten_the_passes():
    run = RunConfig(ppo={"num_rollout_samples": 16})
    one = predict(run, ClusterProfile(kind="local"))
    two = predict(run.model_copy(update={"actor": run.actor.model_copy(update={"data_parallel": 2})}),
                  ClusterProfile(kind="local", components={"actor": {"tasks_per_node": 2}, "critic": {}}))
    assert two.phases["logprobs"] == pytest.approx(one.phases["logprobs"] / 2)
    assert two.phases["generate"] < one.phases["generate"]
    assert two.bounding in two.critical


def test_profile_figures_override_the_defaults():
    got = resolve(HardwareConfig(accelerator="H100", peak_tflops={"bf16": 500}, inter_node_gbs=25))
    assert got.flops("bf16") == 500e12 and got.flops("fp32") == 67e12
    assert got.inter_node_bandwidth == 25e9 and got.memory_bandwidth == 3350e9
    assert resolve(HardwareConfig(), cpus_per_task=4).flops("fp32") == pytest.approx(4 * 0.017e12)
    # latencies in us: the accelerator's, or the profile's (0 included)
    assert got.intra_node_latency == pytest.approx(10e-6) and got.inter_node_latency == pytest.approx(25e-6)
    assert resolve(HardwareConfig(accelerator="H100", intra_node_latency_us=0)).intra_node_latency == 0.0


def test_the_cpu_measurement_is_a_rate():
    assert 1e8 < measure_cpu_flops(n=128, repeats=3) < 1e13


def test_a_batch_costs_what_its_decode_steps_cost_one_by_one():
    # ragged responses (one of 0 tokens): the kept live count and context equal rebuilding the
    # live sequences at every step; the same batch on TP 2 and a slower memory is another cost
    shape = ModelShape.of(RunConfig().model)
    prompts, responses = [5, 9, 2, 7], [4, 0, 11, 4]
    for tp, mem in ((1, 2e8), (2, 2e8), (1, 1e12)):
        h = hw(flops=3e8, mem=mem)
        by_step = sum(shape.forward_flops(p) for p in prompts) / (tp * 3e8)
        for step in range(11):
            by_step += decode_step_s(shape, [p + step for p, r in zip(prompts, responses) if r > step], h, "fp32", tp)
        assert batch_generation_s(shape, prompts, responses, h, "fp32", tp) == pytest.approx(by_step, rel=1e-12)


def test_a_collective_is_its_latency_and_a_rings_bytes():
    assert collective_s(1000, 4, bandwidth=1e6, latency=1e-3) == pytest.approx(1e-3 + 2 * 3 / 4 * 1000 / 1e6)
    assert collective_s(1000, 1, bandwidth=1e6, latency=1e-3) == 0.0
    # the gradient all-reduce pays it once per optimizer step, and the step's two small sums a latency each
    shape = ModelShape.of(RunConfig().model)
    run = RunConfig(actor={"data_parallel": 4, "tensor_parallel": 2})
    assert grad_reduce_s(shape, run.actor, 1e8, reductions=3, latency=1e-3) == \
        pytest.approx(3 * (3 * 1e-3 + 2 * 3 / 4 * PARAMS / 2 * 4 / 1e8))


def test_tensor_parallel_passes_all_reduce_twice_a_layer_per_micro_batch_and_direction():
    shape = ModelShape.of(RunConfig().model)
    run = RunConfig(actor={"data_parallel": 2, "pipeline_parallel": 2, "tensor_parallel": 2})
    # a DP rank: 4 sequences of 10 tokens, 2 micro-batches of 20 tokens x width 64 x 4 bytes; each
    # stage 1 of the 2 layers; forward and backward; 2 TP ranks (a ring moves the bytes once)
    got = tp_pass_link_s(shape, run.actor, [10] * 8, micro_batch=2, dtype="fp32", bandwidth=1e8, latency=1e-3,
                         directions=2)
    assert got == pytest.approx(2 * 2 * 1 * 2 * (1e-3 + 20 * 64 * 4 / 1e8) * (1 + 1 / 2))
    assert tp_pass_link_s(shape, RunConfig().actor, [10] * 8, 2, "fp32", 1e8, 1e-3) == 0.0


def test_an_engine_batch_all_reduces_its_prefill_then_every_decode_step():
    shape = ModelShape.of(RunConfig().model)
    per_token = 64 * 4
    want = 2 * 2 * ((1e-3 + 5 * per_token / 1e8)      # prefill: 2 + 3 prompt tokens
                    + (1e-3 + 2 * per_token / 1e8)    # decode step 0: both sequences
                    + (1e-3 + 1 * per_token / 1e8))   # step 1: the longer one only
    assert batch_link_s(shape, (2, 3), (1, 2), 2, 4, 1e8, 1e-3) == pytest.approx(want)
    assert batch_link_s(shape, (2, 3), (1, 2), 1, 4, 1e8, 1e-3) == 0.0


def test_collectives_join_their_phase_outside_its_efficiency():
    run = RunConfig(actor={"tensor_parallel": 2}, critic={"tensor_parallel": 2})
    prof = ClusterProfile(kind="local", hardware={"accelerator": "H100"},
                          components={"actor": {"tasks_per_node": 2}, "critic": {"tasks_per_node": 2}})
    ideal = ideal_phases(run, prof, Workload(8, (10,), (6,)))
    for phase in ("generate", "logprobs", "train", "critic_infer", "critic_train"):
        assert ideal[f"{phase}.link"] > 0, phase
    got = phase_times(ideal, Costs(efficiency={p: 0.25 for p in ("generate", "logprobs", "train")}))
    for phase in ("generate", "logprobs", "train"):
        assert got[phase] == pytest.approx(ideal[phase] / 0.25 + ideal[f"{phase}.link"]), phase
    # the link is the profile's: its latency (the H100 default 10 us within a node) moves it
    slow = prof.model_copy(update={"hardware": HardwareConfig(accelerator="H100", intra_node_latency_us=1000)})
    assert ideal_phases(run, slow, Workload(8, (10,), (6,)))["generate.link"] > 50 * ideal["generate.link"]


def test_the_collective_latency_measurement_is_a_time():
    assert 0 < measure_collective_latency(repeats=20) < 1.0
