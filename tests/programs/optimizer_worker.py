"""Rank program of tests/integration/test_optimizer.py (not a test): the run's optimizer
(models/optimizer.build_optimizer) on a real megatron GPT over real gloo ranks.

    python tests/programs/optimizer_worker.py zero1 OUT_DIR    # 2 ranks: DP 2
    python tests/programs/optimizer_worker.py resume OUT_DIR   # any rank count: DP = ranks

zero1: the same global batch trained STEPS steps four ways (fp32 / bf16 x replicated / ZeRO-1),
the gradient clip acting; rank 0 writes every way's final weights, gradient norms and each
rank's optimizer bytes (read from the optimizer's tensors) to OUT_DIR/zero1.pt. The bf16 ZeRO-1
run also saves a checkpoint before its last step, then the same world resumes from it (below).
resume: loads that checkpoint at this DP size and runs the last step; rank 0 writes its loss,
LR and the weights after it to OUT_DIR/resume_dp<N>.pt.
Both then train a critic (slurm_align.critic.worker.CriticWorker: value + reward model, ZeRO-1)
CRITIC_STEPS steps on one global batch at DP = ranks; rank 0 writes its losses, the value
model's weights and each rank's optimizer bytes to OUT_DIR/critic_dp<N>.pt.
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from slurm_align.config.run import ModelConfig, TrainingConfig

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_seq_len=16)
STEPS = 3
WAYS = {"fp32": TrainingConfig(), "fp32_zero1": TrainingConfig(distributed_optimizer=True),
        "bf16": TrainingConfig(precision="bf16"),
        "bf16_zero1": TrainingConfig(precision="bf16", distributed_optimizer=True)}


CRITIC_STEPS = 4
CRITIC_TRAINING = TrainingConfig(distributed_optimizer=True)


def init_parallel():
    # Deferred: megatron's checkpoint writer re-imports this file in a spawned process.
    from slurm_align.parallel.bootstrap import init_distributed
    from slurm_align.parallel.layout import initialize_model_parallel
    return initialize_model_parallel(init_distributed(), 1, 1)


def global_batch() -> torch.Tensor:
    return torch.randint(0, MODEL.vocab_size, (8, 16), generator=torch.Generator().manual_seed(5))


def build(pctx, training: TrainingConfig):
    from slurm_align.models.gpt import build_gpt
    from slurm_align.models.optimizer import build_optimizer
    chunks = build_gpt(MODEL, pctx, seed=11, training=training)
    params = [p for c in chunks for p in c.parameters()]
    # A clip below the first steps' norms, so the clipped (sharded) norm is exercised.
    opt = build_optimizer(params, pctx, training, lr=1e-2, weight_decay=0.1, grad_clip=0.5, total_steps=STEPS)
    return chunks, opt


def train_step(pctx, chunks, opt) -> tuple[float, float]:
    """One step on this DP rank's rows of the global batch; (global mean loss, grad norm)."""
    from slurm_align.models.forward import run_schedule
    batch = global_batch()
    mine = batch[pctx.dp_rank::pctx.dp_size]
    count = (batch.shape[0]) * (batch.shape[1] - 1)   # global token count: DP parts sum to the mean

    def loss_fn(logits, mb):
        lp = torch.log_softmax(logits[:, :-1, :MODEL.vocab_size].float(), -1)
        loss = -lp.gather(-1, mb["tokens"][:, 1:, None]).sum() / count
        return loss, {"loss": loss.detach()}

    opt.zero_grad()
    infos = run_schedule(chunks, [{"tokens": mine}], loss_fn, forward_only=False)
    loss = torch.tensor(float(infos[0]["loss"]), dtype=torch.float64)
    dist.all_reduce(loss, group=pctx.dp_group)
    return float(loss), opt.step()


def optimizer_bytes(opt) -> dict[str, int]:
    """Bytes this rank's optimizer holds, read from its tensors: Adam's moments, and the fp32
    main weights where they are a copy (the flat layout's shards)."""
    moments = sum(t.numel() * t.element_size() for st in opt.optimizer.state.values()
                  for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))
    main = sum(b.main.numel() * b.main.element_size() for b in opt.buckets)
    return {"moments": moments, "main": main}


def weights(chunks) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in chunks[0].state_dict().items() if v is not None
            and isinstance(v, torch.Tensor) and "_extra_state" not in k}


def zero1(pctx, out: Path) -> None:
    from slurm_align.models.checkpoint import save_checkpoint
    result = {}
    for name, training in WAYS.items():
        chunks, opt = build(pctx, training)
        losses, norms = [], []
        for step in range(STEPS):
            if name == "bf16_zero1" and step == STEPS - 1:
                save_checkpoint(out / "ckpt", step, chunks, opt, {})
            loss, norm = train_step(pctx, chunks, opt)
            losses.append(loss)
            norms.append(norm)
        sizes: list = [None] * dist.get_world_size()
        dist.all_gather_object(sizes, optimizer_bytes(opt))
        result[name] = {"weights": weights(chunks), "losses": losses, "norms": norms, "bytes": sizes,
                        "main_dtypes": sorted({str(b.main.dtype) for b in opt.buckets}),
                        "param_dtypes": sorted({str(p.dtype) for p in opt.params}),
                        "numel": sum(p.numel() for p in opt.params)}
    if dist.get_rank() == 0:
        torch.save(result, out / "zero1.pt")
    resume(pctx, out)   # at the same DP size, in this world


def resume(pctx, out: Path) -> None:
    from slurm_align.models.checkpoint import find_latest, load_checkpoint
    chunks, opt = build(pctx, WAYS["bf16_zero1"])
    common = load_checkpoint(find_latest(out / "ckpt"), chunks, opt)
    lr = opt.lr
    loss, norm = train_step(pctx, chunks, opt)
    if dist.get_rank() == 0:
        torch.save({"step": int(common["step"]), "loss": loss, "norm": norm, "weights": weights(chunks),
                    "lr": lr, "lr_steps": opt.scheduler.num_steps}, out / f"resume_dp{pctx.dp_size}.pt")


def critic(pctx, out: Path) -> None:
    import numpy as np
    from mpi4py import MPI

    from slurm_align.critic.channel import Command
    from slurm_align.critic.swap import REWARD, VALUE, ModelSwap
    from slurm_align.critic.worker import CriticWorker
    from slurm_align.models.gpt import build_gpt
    models = {VALUE: build_gpt(MODEL, pctx, value_head=True, seed=11, training=CRITIC_TRAINING),
              REWARD: build_gpt(MODEL, pctx, value_head=True, seed=12)}
    worker = CriticWorker(ModelSwap(models, keep_resident=True), pctx, MPI.COMM_WORLD, lr=1e-2, value_clip=0.2,
                          grad_clip=0.5, checkpoint_dir=out / "critic", training=CRITIC_TRAINING,
                          total_steps=CRITIC_STEPS)
    rng = np.random.default_rng(7)   # one global batch: each DP rank trains on its rows
    data = {"tokens": rng.integers(0, MODEL.vocab_size, size=(8, 16)), "lengths": rng.integers(6, 17, size=8),
            "returns": rng.normal(size=(8, 16)).astype(np.float32),
            "prev_values": rng.normal(scale=0.1, size=(8, 16)).astype(np.float32),
            "mask": (rng.random((8, 16)) < 0.8).astype(np.float32)}
    start = weights(models[VALUE])
    losses = [worker.execute(Command("train", data)) for _ in range(CRITIC_STEPS)]
    assert worker.optimizer is not None
    sizes: list = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, optimizer_bytes(worker.optimizer))
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "start": start, "weights": weights(models[VALUE]), "bytes": sizes,
                    "numel": sum(p.numel() for p in worker.optimizer.params)}, out / f"critic_dp{pctx.dp_size}.pt")


if __name__ == "__main__":
    action, out_dir = sys.argv[1], Path(sys.argv[2])
    ctx = init_parallel()
    {"zero1": zero1, "resume": resume}[action](ctx, out_dir)
    critic(ctx, out_dir)
    dist.barrier()
    ctx.destroy()
