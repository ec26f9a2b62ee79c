"""Batch generation (`slurm-align generate`): N sampled responses per prompt of a data set, their
log-probs and, when asked, each response position's top-K log-probs of the model (the teacher
data of offline knowledge distillation, losses/distill.py), written in shards; resumable.

The job is the actor component alone (algorithms/standalone.py, as `slurm-align eval`): the
engine samples (any engine), then, with `top_k_logprobs` K > 0, a forward pass of the megatron
model over prompt+response gives the top-K: `torch.log_softmax` of the float32 logits, the op
the trainers' losses use (models/forward.next_token_logprobs), so the stored values are the
model's own forward, not the engine's approximation of it.

Output: RUN_DIR/generate/shard_<s>.jsonl, shard s holding prompts [s*S, (s+1)*S) of the data
set (S: shard_size), one JSON line per (prompt, sample), by prompt then sample:

    {"index": 17, "sample": 0, "prompt": "7391=", "response": "1379", "prompt_ids": [...],
     "response_ids": [...], "logprobs": [...], "is_end": true,
     "topk_ids": [[...K ids] per response token], "topk_logprobs": [[...K] per response token]}

`logprobs` are the engine's log-probs of the sampled tokens at the sampling temperature;
topk_* at position t are the model's K most likely next tokens (descending) after
prompt + response[:t], at temperature 1. The token ids are stored so that a reader trains on
exactly these tokens (decoding and re-encoding need not round-trip).

JSONL, not parquet: each shard is written whole with rundir.write_atomic (temp file, then
os.replace), so a shard file exists only complete; the data readers (slurm_align/data) read it
as any other JSONL; the top-K lists are ragged per row (response lengths differ), which JSONL
holds as they are. Resume: a shard whose file exists is done and is not redone, so a stopped
and restarted job writes every prompt exactly once. Samples' seeds are a function of (run seed,
prompt index, sample), as sampled evaluation's are (rollout_collector.sample_seed), so a resumed
or re-laid-out job draws the same responses.

Distribution: generation replicas take the pending shards one at a time from the rollouts'
work-stealing prompt server (balance/prompts.py; it hands out shard numbers), so a faster
replica takes more. Without top-K the replica's requester writes each shard as soon as it is
generated. With top-K the forward is collective over the training layout's model-parallel
groups (not the generation replicas when refolded): once every shard is generated, they are
shared over the component and the training layout's data-parallel replicas split their top-K
forwards (pending[r::R]); one rank of each writes. (A stop during generation then keeps none of
that start's shards: they are drawn again, with the same seeds.)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slurm_align.algorithms.rollout_collector import sample_seed
from slurm_align.balance.replica import open_prompt_source, replica_batches
from slurm_align.generation.params import SamplingParams
from slurm_align.models.forward import forward_top_k
from slurm_align.parallel import quiet
from slurm_align.rundir import write_atomic

GENERATE_DRAWS = 1 << 41
"""The `draws` key of generation's per-sample seeds: apart from training steps' and evaluation's."""


TOP_K_MICRO_BATCH = 4
"""Sequences per micro-batch of the top-K forward: bounds its [rows, seq, vocab] float32 log-probs."""


@dataclass(frozen=True)
class GenerateSpec:
    samples: int = 1                # responses per prompt
    temperature: float = 1.0        # sampling temperature (0: greedy)
    top_k_logprobs: int = 0         # K of the stored top-K log-probs (0: none)
    shard_size: int = 64            # prompts per shard file
    max_new_tokens: int = 32
    seed: int = 0                   # the run's seed: every sample's seed derives from it
    forward_batch: int = 64         # sequences per top-K forward call (TOP_K_MICRO_BATCH per micro-batch)


def shard_path(out_dir: Path, shard: int) -> Path:
    return out_dir / f"shard_{shard:05d}.jsonl"


def read_shards(out_dir: Path) -> list[dict[str, Any]]:
    """Every written row, by shard (and so by prompt, then sample)."""
    return [json.loads(line) for p in sorted(out_dir.glob("shard_*.jsonl")) for line in p.read_text().splitlines()]


def pending_shards(out_dir: Path, num_prompts: int, shard_size: int) -> list[int]:
    """The shards without a file (a written file is complete: write_atomic)."""
    count = -(-num_prompts // shard_size)
    return [s for s in range(count) if not shard_path(out_dir, s).exists()]


def sample_rows(engine, prompts: Sequence[np.ndarray], rows: Sequence[dict[str, Any]], indices: Sequence[int],
                spec: GenerateSpec, params: SamplingParams, tokenizer) -> list[dict[str, Any]]:
    """spec.samples responses to each prompt of `indices`, one engine call: rows without top-K."""
    n = spec.samples
    flat = [i for i in indices for _ in range(n)]
    seeds = [sample_seed(spec.seed, GENERATE_DRAWS, i * n + j) for i in indices for j in range(n)]
    out = engine.generate([torch.from_numpy(np.asarray(prompts[i])) for i in flat], params, seeds=seeds)
    logprobs = out.logprobs
    result = []
    for k, (i, resp) in enumerate(zip(flat, out.responses())):
        ids = resp.tolist()
        result.append({"index": i, "sample": k % n, "prompt": rows[i]["prompt"], "response": tokenizer.decode(ids),
                       "prompt_ids": np.asarray(prompts[i]).tolist(), "response_ids": ids,
                       "logprobs": logprobs[k, :len(ids)].tolist() if logprobs is not None else None,
                       "is_end": bool(out.is_end[k])})
    return result


@torch.no_grad()
def add_top_k(policy: list, pctx, rows: list[dict[str, Any]], k: int, vocab_size: int, batch: int) -> None:
    """Adds topk_ids / topk_logprobs to each row (collective over the model-parallel group,
    whose ranks pass the same rows): the model's top-K next-token log-probs after each prefix
    prompt + response[:t], t < len(response)."""
    for a in range(0, len(rows), batch):
        part = rows[a:a + batch]
        seqs = [r["prompt_ids"] + r["response_ids"] for r in part]
        lengths = torch.tensor([len(s) for s in seqs])
        tokens = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.int64)
        for j, s in enumerate(seqs):
            tokens[j, :len(s)] = torch.tensor(s)
        got = forward_top_k(policy, pctx, tokens, vocab_size, k, micro_batch_size=TOP_K_MICRO_BATCH, lengths=lengths,
                            broadcast=True)
        assert got is not None, "broadcast: every pipeline stage has them"
        values, ids = got
        for j, r in enumerate(part):
            p, m = len(r["prompt_ids"]), len(r["response_ids"])
            r["topk_ids"] = ids[j, p - 1:p - 1 + m].tolist()
            r["topk_logprobs"] = values[j, p - 1:p - 1 + m].tolist()


def generate_shards(engine, policy: list, pctx, comm, *, prompts: Sequence[np.ndarray],
                    rows: Sequence[dict[str, Any]], out_dir: Path, spec: GenerateSpec, params: SamplingParams,
                    tokenizer, vocab_size: int, refold: bool = False) -> list[int]:
    """Collective over `comm` (the component's world): writes every pending shard; returns the
    shards this call wrote (the same list on every rank). See the module's docstring."""
    params = dataclasses.replace(params, temperature=spec.temperature, max_new_tokens=spec.max_new_tokens,
                                 return_logprobs=True)
    pending = comm.bcast(pending_shards(out_dir, len(prompts), spec.shard_size) if comm.rank == 0 else None, root=0)
    held: list[tuple[int, list[dict[str, Any]]]] = []   # with top-K: generated, forward still to run
    with pctx.generation_layout(refold) as layout:
        # the work-stealing prompt server hands out shard numbers: a faster replica takes more
        source = open_prompt_source(comm, layout, np.asarray(pending, dtype=np.int64))
        for batch in replica_batches(layout, source, 1):
            shard = int(batch[0])
            idx = list(range(shard * spec.shard_size, min((shard + 1) * spec.shard_size, len(prompts))))
            got = sample_rows(engine, prompts, rows, idx, spec, params, tokenizer)
            if not layout.is_requester:
                continue
            if spec.top_k_logprobs:
                held.append((shard, got))
            else:   # done: on disk at once, so a stop keeps it
                write_atomic(shard_path(out_dir, shard), "".join(json.dumps(row) + "\n" for row in got))
        source.close()
    if spec.top_k_logprobs:
        # the top-K forward is collective over the training layout's model-parallel groups, which
        # need not be the generation replicas (refold): once every shard is generated, the
        # training layout's data-parallel replicas split them (its MP group's ranks agree)
        quiet.barrier(comm)
        done = sorted((p for part in comm.allgather(held) for p in part), key=lambda p: p[0])
        for shard, got in done[pctx.dp_rank::pctx.dp_size]:
            add_top_k(policy, pctx, got, spec.top_k_logprobs, vocab_size, spec.forward_batch)
            if pctx.tp_rank == 0 and pctx.is_last_stage:
                write_atomic(shard_path(out_dir, shard), "".join(json.dumps(row) + "\n" for row in got))
    quiet.barrier(comm)   # every file is on disk before anyone counts them
    return pending


def prompt_dataset(run, data: Path, tokenizer):
    """The prompts as the engine gets them: conditioned on eval.attributes (SteerLM) when set."""
    from slurm_align.algorithms.steerlm import prompt_suffix
    from slurm_align.data.datasets import PromptDataset

    return PromptDataset(data, tokenizer, run.model.max_seq_len, run.data.columns,
                         suffix=prompt_suffix(run.eval.attributes))


def run_generate(run, rd, env, data: Path, spec: GenerateSpec) -> list[int]:
    """The job's body on every rank (launchers/generate.py): load, refit, generate the pending shards."""
    from slurm_align.algorithms.standalone import load_standalone_actor

    actor = load_standalone_actor(run, env)
    dataset = prompt_dataset(run, data, actor.tokenizer)
    params = SamplingParams.from_config(run.generation, eos_id=actor.tokenizer.eos_id, pad_id=actor.tokenizer.pad_id)
    wrote = generate_shards(actor.engine, actor.policy, actor.pctx, env.comm, prompts=dataset.token_arrays(),
                            rows=dataset.fields(), out_dir=rd.root / "generate", spec=spec, params=params,
                            tokenizer=actor.tokenizer, vocab_size=run.model.vocab_size, refold=run.switches.refold)
    if env.rank == 0:
        print(json.dumps({"generate": {"shards_written": len(wrote), "prompts": len(dataset)}}), flush=True)
    return wrote
