"""Disaggregated rollouts (rollout.mode 'disaggregated'): the generator component, and the
actor's end of its stream.

The generator's ranks (generator.data_parallel replicas of the policy, each of
generator.tensor_parallel ranks: TP 1 for the torch engines, a TensorRT-LLM LLM over its ranks'
GPUs otherwise) run the rollout collector (prompt server over the component, per-sample seeds,
the rule reward);
rank 0 serves one authenticated Stream (generation/stream.py) at its own address, published in
RUN_DIR/generator_address.json, to the actor's rank 0 (which sends each micro-batch on to the
critic, when the run has one: PPO's values, a reward model's score):

    actor -> generator   start {start_step}; weights {version, bucket i of n} after each
                         optimizer step (rollout.weight_transport 'collective': weights_meta
                         instead, the bucket itself over a gloo group; generation/weight_group.py);
                         stop
    generator -> actor   samples {step} (a finished micro-batch: whole groups, each sample with
                         the weight version that generated it); step_done {step}

Staleness: step s may be generated with weights of version v >= s - 1 - k (k =
rollout.max_off_policy_steps; version = optimizer steps taken). Before each step the generator
applies the newest complete version it has (between requests, never during one; rollout.lag
'fixed': version s - 1 - k exactly, whatever came since) and waits only while it has none new
enough; k = 0 is on-policy and in lock-step with the trainer. The actor
checks every sample again (`stale_mask`): an older one is never trained on (its weight is 0,
counted as dropped).

Resume: the actor sends its start step and its checkpoint's weights; the generator regenerates
from there with the same per-sample seeds (nothing is stored with the checkpoint). With k = 0
the regenerated samples equal the lost ones; with k > 0 they may come from newer weights.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurm_align.algorithms.policy_gradient import Rewards
from slurm_align.algorithms.rollout_batch import RolloutBatch, all_reduce_sums, collective_device
from slurm_align.algorithms.rollout_collector import VERSION, RolloutCollector
from slurm_align.config import RunConfig, load_run_config
from slurm_align.data.mixture import run_prompts
from slurm_align.generation import engine_from_config
from slurm_align.generation.base import TorchEngineBase
from slurm_align.generation.params import GptShape
from slurm_align.generation.stream import STOP, Stream, StreamClosed, StreamServer, connect
from slurm_align.generation.weight_group import META, GroupReceiver, GroupSender, open_group
from slurm_align.generation.weight_stream import WeightAssembler, send_weights
from slurm_align.generation.weights import expected_shapes
from slurm_align.models.lora import merged
from slurm_align.models.tokenizer import build_tokenizer
from slurm_align.models.weights import full_state_dict
from slurm_align.parallel import quiet
from slurm_align.parallel.bootstrap import init_distributed
from slurm_align.profiling import phases as P
from slurm_align.profiling.timers import Tracer
from slurm_align.rundir import RunDir, address_problem, publish_address, read_run_secret
from slurm_align.slurm.hetenv import service_host

COMPONENT = "generator"
WEIGHT_DIGESTS = {"generator": "generator_weights.jsonl", "trainer": "trainer_weights.jsonl"}
"""RUN_DIR files (rollout.record_weight_digests): per weight version, the sha256 of each tensor
the generator's engine holds once it applied it, and of each tensor the trainer sent."""


@dataclass(frozen=True)
class ReplicaLayout:
    """Where a generator rank generates (the GenerationLayout fields the engine and the collector
    read): replica dp_rank of dp_size, each of tp_size consecutive ranks of the component."""
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    mp_comm: Any
    """mpi4py communicator over the replica's ranks; its rank 0 is the requester."""
    pp_size: int = 1

    @property
    def is_requester(self) -> bool:
        return self.tp_rank == 0


def replica_layout(comm, tensor_parallel: int) -> ReplicaLayout:
    """Collective over the generator's ranks: consecutive groups of tensor_parallel ranks (one
    node's GPUs on a cluster, as TensorRT-LLM needs) form one replica each."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size % tensor_parallel:
        raise ValueError(f"generator: {size} ranks do not split into replicas of generator.tensor_parallel="
                         f"{tensor_parallel}")
    dp_rank, tp_rank = divmod(rank, tensor_parallel)
    return ReplicaLayout(dp_rank, size // tensor_parallel, tp_rank, tensor_parallel, comm.Split(dp_rank, tp_rank))


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes."""
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(f"{t.dtype} {tuple(t.shape)} ".encode() + t.view(torch.uint8).numpy().tobytes()).hexdigest()


def record_digests(rd: RunDir, side: str, version: int, tensors: dict[str, torch.Tensor]) -> None:
    line = json.dumps({"version": int(version), "sha256": {k: tensor_digest(t) for k, t in tensors.items()}})
    with open(rd.root / WEIGHT_DIGESTS[side], "a") as f:
        f.write(line + "\n")


# -- the generator component ------------------------------------------------------------------
class _Stopped(Exception):
    pass


class Generator:
    """One generator rank: its engine and collector; rank 0 also holds the actor's stream."""

    def __init__(self, run: RunConfig, rd: RunDir, env):
        self.run, self.rd, self.env, self.comm = run, rd, env, env.comm
        self.rank = env.rank
        torch.manual_seed(run.seed)
        tokenizer = build_tokenizer(run.model)
        dataset = run_prompts(run, tokenizer)   # data.train_path or data.mixture
        self.shape = GptShape.from_model_config(run.model)
        self.layout = replica_layout(self.comm, run.generator.tensor_parallel)
        self.engine = engine_from_config(run, env.device, self.layout)
        self.tracer: Tracer | None = None
        self.collector = RolloutCollector(run, self.engine, tokenizer, dataset.token_arrays(),
                                          Rewards(run, tokenizer, dataset.fields()), rank=env.rank)
        self.stream: Stream | None = None
        self.group: GroupReceiver | None = None   # rollout.weight_transport 'collective'
        self.assembler = WeightAssembler()
        self.version = -1

    def serve(self) -> int:
        """Rank 0: bind, publish, accept the actor; every rank: the start step."""
        start = None
        if self.rank == 0:
            secret = read_run_secret(self.rd)
            server = StreamServer(service_host(COMPONENT, self.run.rollout.bind_host), secret)
            publish_address(self.rd, COMPONENT, server.host, server.port, secret)
            self.stream = server.accept(timeout=self.run.rollout.connect_timeout_s)
            server.close()   # one peer: nobody else may connect later
            msg = self.stream.recv()
            if msg.kind != "start":
                raise RuntimeError(f"the actor's first message is {msg.kind!r}, expected 'start'")
            start = int(msg.meta["start_step"])
            if self.run.rollout.weight_transport == "collective":
                self.group = GroupReceiver(open_group(self.stream, 1, server.host, self.run.rollout.connect_timeout_s))
                print(f"weights: gloo group with the trainer, bound to {server.host}, rendezvous over the stream",
                      flush=True)
        start = self.comm.bcast(start, root=0)
        self.tracer = Tracer(self.rd.root, COMPONENT, self.rank, resume_from_step=start)
        self.collector.tracer = self.tracer
        return start

    def _newest_weights(self, need: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Rank 0: the newest complete version waiting (waits while none >= need has come); with
        rollout.lag 'fixed', version `need` itself (later ones stay queued in the stream)."""
        fixed = self.run.rollout.lag == "fixed"
        stream = self.stream
        assert stream is not None, "rank 0 holds the actor's stream (serve)"
        newest = None
        while True:
            have = newest[0] if newest is not None else self.version
            if have >= need and fixed:
                return newest
            msg = stream.recv() if have < need else stream.poll()
            if msg is None:
                return newest
            if msg.kind == STOP:
                raise _Stopped()   # the actor ended early (a stop for preemption): it decides
            done = self._feed(msg)
            if done is not None:
                newest = done

    def _feed(self, msg):
        """A weights message (or a collective bucket's announcement: then the bucket itself)."""
        if msg.kind == META:
            assert self.group is not None, "only rollout.weight_transport 'collective' announces buckets"
            msg = self.group.receive(msg)
        return self.assembler.feed(msg)

    def apply_weights(self, step: int, need: int) -> None:
        assert self.tracer is not None, "serve() first"
        with self.tracer.span(P.WEIGHT_SYNC, step):
            got, stopped = None, False
            if self.rank == 0:
                try:
                    got = self._newest_weights(need)
                except _Stopped:
                    stopped = True
            if self.comm.Get_size() > 1:
                quiet.barrier(self.comm)   # while rank 0 waits for the trainer's weights
                got, stopped = self.comm.bcast((got, stopped), root=0)
            if stopped:
                raise _Stopped()
            if got is None:
                return
            version, sd = got
            self.engine.refit(sd)
            self.version = version
            self.collector.set_version(version)
        if self.rank == 0 and self.run.rollout.record_weight_digests:   # what the engine now holds
            engine = self.engine
            assert isinstance(engine, TorchEngineBase), "RunConfig refuses record_weight_digests with trtllm"
            record_digests(self.rd, "generator", version,
                           {k: engine.weights[k] for k in expected_shapes(self.shape)})

    def send(self, kind: str, meta: dict, tensors: dict | None = None) -> None:
        """Rank 0: to the actor; after the actor's stop (preemption: it saved and ends) the
        generator stops too, whatever it was doing."""
        stream = self.stream
        assert stream is not None, "rank 0 holds the actor's stream (serve)"
        if stream.peer_stopped:
            raise _Stopped()
        try:
            stream.send(kind, meta, tensors)
        except StreamClosed:
            if stream.peer_stopped:
                raise _Stopped() from None
            raise

    def step(self, step: int, need: int) -> None:
        self.apply_weights(step, need)
        on_batch = (lambda mb: self.send("samples", {"step": step}, mb.pack())) if self.rank == 0 else None
        got = self.collector.collect(step, self.comm, self.layout, on_batch=on_batch)
        if self.comm.Get_size() > 1:   # the other ranks' samples go out through rank 0
            quiet.barrier(self.comm)   # while rank 0 streams its own batches out
            parts = self.comm.gather(got.batch.pack() if self.rank else None, root=0)
            if self.rank == 0:
                rest = RolloutBatch.unpack(parts[1:], self.collector.pad_id)
                if rest.size:
                    self.send("samples", {"step": step}, rest.pack())
        if self.rank == 0:
            self.send("step_done", {"step": step})
        assert self.tracer is not None, "serve() first"
        self.tracer.step_done(step)

    def run_loop(self, start: int) -> None:
        run = self.run
        k = run.rollout.max_off_policy_steps
        try:
            for step in range(start, run.ppo.num_steps + 1):
                self.step(step, need=max(step - 1 - k, start - 1))
        except _Stopped:
            return   # the actor saved and ends (preemption); so does the generator
        if self.rank == 0:   # the actor's remaining weight versions, then its stop
            assert self.stream is not None, "rank 0 holds the actor's stream (serve)"
            while (msg := self.stream.recv()).kind != STOP:
                self._feed(msg)

    def close(self) -> None:
        self.collector.close()   # multi-turn: the environment's tool workers
        self.engine.free()       # TensorRT-LLM: its LLM and Ray workers shut down
        if self.tracer is not None:
            self.tracer.close()
        if self.stream is not None:
            self.stream.close()


def main(run_dir: str | Path) -> int:
    rd = RunDir(Path(run_dir))
    run = load_run_config(rd.config)
    env = init_distributed()
    gen: Generator | None = None
    try:
        gen = Generator(run, rd, env)
        gen.run_loop(gen.serve())
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        env.comm.Abort(1)   # the component ends at once: the job script fails the job
    assert gen is not None, "Abort ends the process"
    gen.close()
    return 0


# -- the actor's end --------------------------------------------------------------------------
class RemoteRollouts:
    """The actor's side of the generator's stream: its rank 0 holds the connection; weights are
    gathered from the model-parallel shards (collective) and sent by global rank 0."""

    def __init__(self, run: RunConfig, rd: RunDir, rank: int, pad_id: int):
        self.run, self.rd, self.rank, self.pad_id = run, rd, rank, pad_id
        self.stream: Stream | None = None
        self.group: GroupSender | None = None   # rollout.weight_transport 'collective'
        self.bucket_bytes = int(run.rollout.weight_bucket_mb * 2**20)

    def connect(self, start_step: int) -> None:
        """Rank 0: wait for the generator's published address, connect, send the start step."""
        if self.rank != 0:
            return
        secret = read_run_secret(self.rd)
        deadline = time.monotonic() + self.run.rollout.connect_timeout_s
        delay = 0.05
        while True:
            found, why = address_problem(self.rd, COMPONENT, secret)
            if found is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the generator published no address within "
                                   f"rollout.connect_timeout_s={self.run.rollout.connect_timeout_s} s: {why}")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        self.stream = connect(*found, secret)
        self.stream.send("start", {"start_step": int(start_step)})
        if self.run.rollout.weight_transport == "collective":
            host = self.stream.sock.getsockname()[0]   # the address the generator reaches this rank at
            self.group = GroupSender(self.stream, open_group(self.stream, 0, host, self.run.rollout.connect_timeout_s))

    def sync(self, policy: list, pctx, version: int) -> dict[str, float]:
        """Collective over the actor: the full weights after `version` optimizer steps to the
        generator. Returns bytes and seconds (rank 0's; 0 elsewhere)."""
        t0 = time.perf_counter()
        with merged(policy):   # LoRA: the generator generates with W + scale * B A
            sd = full_state_dict(policy, pctx, to_all=False) if pctx.dp_rank == 0 else None
        sent = 0
        if self.rank == 0:
            assert sd is not None, "global rank 0 is a DP rank 0"
            assert self.stream is not None, "rank 0 holds the generator's stream (connect)"
            send = self.group.send if self.group is not None else partial(send_weights, self.stream)
            sent = send(sd, version, self.bucket_bytes)
            if self.run.rollout.record_weight_digests:
                record_digests(self.rd, "trainer", version, sd)
        return {"weight_sync_bytes": float(sent), "weight_sync_s": time.perf_counter() - t0}

    def receive(self, step: int) -> list[RolloutBatch]:
        """Rank 0: the step's micro-batches, as the generator finished them; [] elsewhere."""
        if self.rank != 0:
            return []
        assert self.stream is not None, "rank 0 holds the generator's stream (connect)"
        out: list[RolloutBatch] = []
        while True:
            msg = self.stream.recv()
            if msg.kind == "step_done":
                if int(msg.meta["step"]) != step:
                    raise RuntimeError(f"the generator finished step {msg.meta['step']}, expected {step}")
                return out
            if msg.kind != "samples" or int(msg.meta["step"]) != step:
                raise RuntimeError(
                    f"unexpected {msg.kind!r} message for step {msg.meta.get('step')} during step {step}")
            out.append(RolloutBatch.unpack([{k: v.numpy() for k, v in msg.tensors.items()}], self.pad_id))

    def close(self) -> None:
        if self.stream is not None:
            if self.group is not None:   # the generator takes what was posted before it sees the stop
                self.group.close(self.run.rollout.connect_timeout_s)
            self.stream.send(STOP)
            self.stream.close()


def stale_mask(run: RunConfig, shard: RolloutBatch, step: int, dp_group) -> dict[str, float]:
    """Zero the 'train' weight of samples older than rollout.max_off_policy_steps (the trainer
    holds version step - 1). Returns the counts, summed over DP."""
    staleness = (step - 1) - shard[VERSION].long() if shard.size else torch.zeros(0, dtype=torch.long)
    stale = staleness > run.rollout.max_off_policy_steps
    if shard.size:
        shard.set_samples("train", shard["train"] * (~stale).float())
    s = all_reduce_sums({"dropped": stale.sum()}, dp_group)
    worst = torch.tensor([float(staleness.max()) if shard.size else 0.0], dtype=torch.float64)
    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        worst = worst.to(collective_device(dp_group))
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=dp_group)
    return {"dropped_stale": s["dropped"], "max_staleness": float(worst.item())}
