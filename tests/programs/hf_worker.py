"""Rank program for tests/integration/test_hf_models.py (run under mpirun; not a test).

    python tests/programs/hf_worker.py ACTION TP PP DIR

- logits:  every HF folder under DIR/models imported at TP x PP (build_gpt with model.hf_path);
           rank 0 saves its logits (values for *_rm folders) to DIR/out/<name>_tp<TP>_pp<PP>.pt;
- tied_grads: gradients of a tied embedding after the trainers' reduction (see tied_grads);
- own_gpt: slurm-align's own GPT and reward model saved as checkpoints (see own_gpt);
- resave:  the trained checkpoint named in DIR/ckpt.txt loaded at TP x PP: its logits, and the
           same weights saved again at this layout (see resave).

tests/programs/plan_worker.py runs several of these actions, at several layouts, in one launch.
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from models_worker import init_parallel  # same folder: mpirun runs this file directly

from slurm_align.config.run import ModelConfig
from slurm_align.models.checkpoint import load_weights, save_checkpoint
from slurm_align.models.forward import forward_logits, forward_values
from slurm_align.models.gpt import build_gpt

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()


def logits(pctx, root: Path) -> None:
    tokens = torch.load(root / "tokens.pt")
    (root / "out").mkdir(exist_ok=True)
    for folder in sorted((root / "models").iterdir()):
        cfg = ModelConfig(hf_path=folder)
        value = folder.name.endswith("_rm")
        chunks = build_gpt(cfg, pctx, value_head=value, seed=5)
        y = (forward_values(chunks, pctx, tokens, broadcast=True) if value
             else forward_logits(chunks, pctx, tokens, cfg.vocab_size, broadcast=True))
        if dist.get_rank() == 0:
            torch.save(y, root / "out" / f"{folder.name}_tp{pctx.tp_size}_pp{pctx.pp_size}.pt")


def resave(pctx, root: Path) -> None:
    """The trained checkpoint (DIR/ckpt.txt, any layout) loaded at TP x PP: rank 0 saves its
    logits on DIR/tokens.pt to DIR/trained_logits.pt; the model is saved again, at this layout,
    as a training checkpoint under DIR/resaved/checkpoints/sft beside a copy of the run config."""
    trained = Path((root / "ckpt.txt").read_text().strip())
    cfg = ModelConfig(hf_path=(root / "hf_dir.txt").read_text().strip(), init_checkpoint=trained)
    chunks = build_gpt(cfg, pctx, seed=99)
    load_weights(trained, chunks)
    y = forward_logits(chunks, pctx, torch.load(root / "tokens.pt"), cfg.vocab_size, broadcast=True)
    run_dir = root / "resaved"
    save_checkpoint(run_dir / "checkpoints" / "sft", 10, chunks, None, {"algorithm": "sft"})
    if dist.get_rank() == 0:
        torch.save(y, root / "trained_logits.pt")
        shutil.copy(trained.parent.parent.parent / "config.yaml", run_dir)


def own_gpt(pctx, root: Path) -> None:
    """slurm-align's own GPT (the ModelConfig defaults: learned positions, LayerNorm, exact GELU,
    biases, untied) and its reward-model twin, random, saved as checkpoints with their model
    config; rank 0 saves their logits / values on DIR/tokens.pt to DIR/own_<kind>.pt."""
    cfg = ModelConfig(vocab_size=260, max_seq_len=32)
    tokens = torch.load(root / "tokens.pt")
    for kind, value in (("lm", False), ("rm", True)):
        chunks = build_gpt(cfg, pctx, value_head=value, seed=3)
        y = (forward_values(chunks, pctx, tokens, broadcast=True) if value
             else forward_logits(chunks, pctx, tokens, cfg.vocab_size, broadcast=True))
        save_checkpoint(root / f"own_{kind}", 0, chunks, None,
                        {"model_config": cfg.model_dump(mode="json"), "value_head": value})
        if dist.get_rank() == 0:
            torch.save(y, root / f"own_{kind}.pt")


def tied_grads(pctx, root: Path) -> None:
    """One backward step of the tied Qwen2 through megatron's schedule and the trainers' gradient
    reduction; rank 0 saves the embedding's gradient (first stage) and, under PP, every rank's
    view of the tied pair to DIR/tied_pp<PP>_rank<r>.pt."""
    from slurm_align.models.forward import run_schedule
    from slurm_align.models.optimizer import reduce_gradients
    cfg = ModelConfig(hf_path=root / "models" / "qwen2")
    chunks = build_gpt(cfg, pctx)
    tokens = torch.load(root / "tokens.pt")
    mbs = [{"tokens": t} for t in tokens.split(1)]
    run_schedule(chunks, mbs, lambda out, mb: (out.float().pow(2).mean() / len(mbs), {}), forward_only=False)
    params = [p for c in chunks for p in c.parameters()]
    reduce_gradients(params, pctx, clip=None)
    tied = {}
    if pctx.is_first_stage:
        tied["embedding"] = chunks[0].embedding.word_embeddings.weight.grad.clone()
    if pctx.is_last_stage and pctx.pp_size > 1:
        tied["output_copy"] = chunks[0].output_layer.weight.grad.clone()
    torch.save(tied, root / f"tied_pp{pctx.pp_size}_rank{dist.get_rank()}.pt")


ACTIONS = {"logits": logits, "resave": resave, "own_gpt": own_gpt, "tied_grads": tied_grads}


def main(argv: list[str]) -> int:
    action, tp, pp, root = argv[0], int(argv[1]), int(argv[2]), Path(argv[3])
    pctx = init_parallel(tp, pp)
    ACTIONS[action](pctx, root)
    dist.barrier()
    pctx.destroy()
    return 0


if __name__ == "__main__":
    from slurm_align.launchers import leave

    leave(main(sys.argv[1:]))   # as the product's launchers end
