"""Rank program for tests/integration/test_hf_qwen3_moe.py's MoE tests (run under mpirun; not a test).

    python tests/programs/moe_worker.py ACTION TP PP EP DIR

- logits: every HF folder under DIR/models imported at TP x PP x EP (build_gpt with
          model.hf_path); rank 0 saves its logits on DIR/tokens.pt to
          DIR/out/<name>_tp<TP>_pp<PP>_ep<EP>.pt, every rank the names of the HF tensors it
          read to DIR/out/<name>_ep<EP>_read<rank>.pt;
- grads:  reduced gradients and their norm of one backward step (see grads).

tests/programs/plan_worker.py runs several of these actions, at several layouts, in one launch.
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from slurm_align.config.run import ModelConfig
from slurm_align.models.forward import forward_logits
from slurm_align.models.gpt import build_gpt
from slurm_align.models.hf.loader import SafetensorsFolder
from slurm_align.parallel.bootstrap import init_distributed
from slurm_align.parallel.layout import initialize_model_parallel

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()


def logits(pctx, root: Path) -> None:
    tokens = torch.load(root / "tokens.pt")
    (root / "out").mkdir(exist_ok=True)
    read: list[str] = []
    plain_read = SafetensorsFolder.read

    def recording_read(self, name, *args):  # which HF tensors this rank reads
        read.append(name)
        return plain_read(self, name, *args)

    SafetensorsFolder.read = recording_read
    try:
        for folder in sorted((root / "models").iterdir()):
            cfg = ModelConfig(hf_path=folder)
            read.clear()
            chunks = build_gpt(cfg, pctx, seed=5)
            torch.save(sorted(set(read)), root / "out" / f"{folder.name}_ep{pctx.ep_size}_read{dist.get_rank()}.pt")
            y = forward_logits(chunks, pctx, tokens, cfg.vocab_size, broadcast=True)
            if dist.get_rank() == 0:
                torch.save(y, root / "out" / f"{folder.name}_tp{pctx.tp_size}_pp{pctx.pp_size}_ep{pctx.ep_size}.pt")
    finally:   # plan_worker may run this again in the same process
        SafetensorsFolder.read = plain_read


def grads(pctx, root: Path) -> None:
    """One backward of the Qwen3-MoE in DIR/hf_dir.txt (aux loss off) on DIR/tokens.pt split
    over the DP ranks, through the trainers' gradient reduction; rank 0 saves the norm and every
    parameter's reduced gradient by global name (all experts) to DIR/grads_ep<EP>.pt."""
    from slurm_align.models.forward import run_schedule
    from slurm_align.models.optimizer import reduce_gradients
    from slurm_align.models.weights import is_expert, local_tensors
    cfg = ModelConfig(hf_path=(root / "hf_dir.txt").read_text().strip(), moe_aux_loss_coeff=0.0)
    chunks = build_gpt(cfg, pctx, seed=5)
    tokens = torch.load(root / "tokens.pt")
    mine = tokens.chunk(pctx.dp_size)[pctx.dp_rank]
    mbs = [{"tokens": t} for t in mine.chunk(2 // pctx.dp_size)]
    # each sequence's share of the global mean (the trainers' convention: summed over DP)
    run_schedule(chunks, mbs, lambda out, mb: (out.float().pow(2).mean() / tokens.shape[0], {}), forward_only=False)
    params = [p for c in chunks for p in c.parameters()]
    norm = reduce_gradients(params, pctx, clip=None)
    by_name = {id(t): n for n, t in local_tensors(chunks, pctx)}
    got = {by_name[id(p)]: p.grad.clone() for p in params}
    peers = [None] * pctx.ep_size
    dist.all_gather_object(peers, {k: v for k, v in got.items() if is_expert(k)}, group=pctx.ep_group)
    for peer in peers:
        got.update(peer)
    if dist.get_rank() == 0:
        torch.save({"norm": norm, "grads": got}, root / f"grads_ep{pctx.ep_size}.pt")


ACTIONS = {"logits": logits, "grads": grads}


def main(argv: list[str]) -> int:
    action, tp, pp, ep, root = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    pctx = initialize_model_parallel(init_distributed(), tp, pp, ep)
    ACTIONS[action](pctx, root)
    dist.barrier()
    pctx.destroy()
    return 0


if __name__ == "__main__":
    from slurm_align.launchers import leave

    leave(main(sys.argv[1:]))   # as the product's launchers end
