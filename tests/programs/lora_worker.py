"""Rank program for tests/integration/test_lora.py (run under mpirun; not a test).

    python tests/programs/lora_worker.py TP RUN_DIR

RUN_DIR holds config.yaml (an SFT run with model.lora, actor.tensor_parallel = TP) and tokens.pt.
Each rank: the base model's logits, the same model with adapters attached (B = 0), its adapter
shapes, and the base saved as a checkpoint without LoRA (RUN_DIR/full); then the real SFT Trainer
trains the run (adapters only) and saves its checkpoint; afterwards the trained model's base
tensors, adapters, reference (adapters off) log-probs and merged weights are compared; then a DPO
run with LoRA (RUN_DIR/dpo.yaml) trains into RUN_DIR/dpo. Rank r writes RUN_DIR/result<r>.json; rank
0 also RUN_DIR/lora_logits.pt (the trained LoRA model's logits on tokens.pt).
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

from models_worker import init_parallel

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()


def main(tp: int, root: Path) -> None:
    import torch.distributed as dist

    from slurm_align.algorithms.trainer import Trainer
    from slurm_align.config import load_run_config
    from slurm_align.models.checkpoint import save_checkpoint
    from slurm_align.models.forward import forward_logits, forward_logprobs
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.lora import adapter_tensors, attach_lora, merged, reference_policy
    from slurm_align.models.weights import local_tensors

    pctx = init_parallel(tp, 1)
    run = load_run_config(root / "config.yaml")
    toks, vocab = torch.load(root / "tokens.pt"), run.model.vocab_size
    res: dict = {}

    base = build_gpt(run.model, pctx, seed=run.seed)
    base_logits = forward_logits(base, pctx, toks, vocab, broadcast=True)
    base_logp = forward_logprobs(base, pctx, toks, vocab, broadcast=True)
    save_checkpoint(root / "full", 0, base, None, {"algorithm": "sft"})   # a checkpoint without LoRA
    attach_lora(base, run.model.lora, pctx, run.seed)
    res["init_logits_equal"] = torch.equal(forward_logits(base, pctx, toks, vocab, broadcast=True), base_logits)
    res["shapes"] = {k: list(p.shape) for k, p in adapter_tensors(base)}
    res["tp_split"] = {k: (p.partition_dim if p.tensor_model_parallel else None) for k, p in adapter_tensors(base)}

    trainer = Trainer(run, pctx, root)
    res["optimizer_params"] = sum(p.numel() for p in trainer.worker.optimizer.params)   # what it trains
    res["adapter_params"] = sum(p.numel() for _, p in adapter_tensors(trainer.chunks))
    trainer.fit()
    chunks = trainer.chunks
    base_tensors = dict(local_tensors(base, pctx))

    def same_base() -> bool:   # every base tensor bit-identical to the untrained base's
        mine = dict(local_tensors(chunks, pctx))
        return list(mine) == list(base_tensors) and all(torch.equal(t, base_tensors[k]) for k, t in mine.items())

    res["base_identical"] = same_base()
    untrained = dict(adapter_tensors(base))
    res["adapters_changed"] = {k: not torch.equal(p, untrained[k]) for k, p in adapter_tensors(chunks)}

    lora_logits = forward_logits(chunks, pctx, toks, vocab, broadcast=True)
    res["lora_differs_from_base"] = (lora_logits - base_logits).abs().max().item()
    ref = reference_policy(chunks)
    ref.swap()   # adapters off: the reference policy
    try:
        res["reference_logprobs_equal_base"] = torch.equal(
            forward_logprobs(chunks, pctx, toks, vocab, broadcast=True), base_logp)
        with merged(chunks):   # what the refit hands the engine: W + scale * B A on each shard
            merged_logits = forward_logits(chunks, pctx, toks, vocab, broadcast=True)
    finally:
        ref.swap()
    res["merged_err"] = (merged_logits - lora_logits).abs().max().item()
    res["base_back_after_merge"] = same_base()
    # DPO with LoRA (RUN_DIR/dpo.yaml, the same model): its reference is the adapters-off model
    dpo = load_run_config(root / "dpo.yaml")
    (root / "dpo").mkdir(exist_ok=True)
    Trainer(dpo, pctx, root / "dpo").fit()
    rank = dist.get_rank()
    (root / f"result{rank}.json").write_text(json.dumps(res))
    if rank == 0:
        torch.save(lora_logits, root / "lora_logits.pt")
    pctx.destroy()


if __name__ == "__main__":
    from slurm_align.launchers import leave

    main(int(sys.argv[1]), Path(sys.argv[2]))
    leave(0)   # as the product's launchers end
