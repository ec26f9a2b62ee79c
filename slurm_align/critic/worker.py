"""What every critic rank does for a command: the collective forward / update / save.

Rows of a batch are split over data-parallel ranks; all ranks of one model-parallel replica
see the same rows. Results come back to rank 0 through one MPI gather from the ranks that
hold them (last pipeline stage, TP rank 0).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slurm_align.config.run import ModelConfig, TrainingConfig
from slurm_align.critic.channel import Command
from slurm_align.critic.swap import REWARD, VALUE, ModelSwap
from slurm_align.losses.registry import ValueOptions
from slurm_align.losses.value import ValueLoss
from slurm_align.models.checkpoint import load_checkpoint, save_checkpoint
from slurm_align.models.forward import forward_values, last_token_values
from slurm_align.models.optimizer import build_optimizer
from slurm_align.models.packing import Batching, micro_batch_inputs
from slurm_align.models.weights import full_state_dict
from slurm_align.models.worker import ModelWorker
from slurm_align.parallel import quiet
from slurm_align.rundir import fsync_dir

_ITER_FILE = re.compile(r"^iter_(\d+)\.pt$")


def save_atomic_torch(obj: Any, path: Path) -> Path:
    """torch.save to a temp file, fsync, rename, fsync the folder: durable and all-or-nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


class ValueTargets:
    """The value model's training data of one step: tokens [N, L], lengths [N] and per-position
    columns [N, L] (returns, prev, mask); forms the model worker's micro-batches."""

    def __init__(self, tokens: torch.Tensor, lengths: torch.Tensor, per_position: dict[str, torch.Tensor]):
        self.tokens, self.lengths, self.per_position = tokens, lengths, per_position

    def loss_microbatches(self, indices: list[int], batching: Batching | int, columns, *,
                          fixed_shape: bool) -> list[dict]:
        if isinstance(batching, int):
            batching = Batching(micro_batch_size=batching)
        idx = torch.as_tensor(indices, dtype=torch.int64)
        tok, seq_len = self.tokens[idx], self.lengths[idx]
        per_pos = {k: v[idx] for k, v in self.per_position.items()}
        mbs = []
        for inp in micro_batch_inputs(tok, seq_len, batching.groups(seq_len), pack=batching.pack,
                                      fixed_shape=fixed_shape):
            mb = {"tokens": inp["tokens"], **{k: v[inp["rows"]] for k, v in per_pos.items()}}
            mb["mask"] = mb["mask"] * inp["real"][:, None]   # filler rows (fixed shapes) count nothing
            if "packing" in inp:
                mb["packing"] = inp["packing"]
                width = int(inp["packing"].lengths.max())   # per_sequence's width
                mb.update({k: mb[k][:, :width] for k in per_pos})
            mbs.append(mb)
        return mbs


class CriticWorker:
    def __init__(self, swap: ModelSwap, pctx: Any, comm, *, lr: float, value_clip: float,
                 checkpoint_dir: Path, grad_clip: float = 0.0, batching: Batching = Batching(),
                 training: TrainingConfig | None = None, total_steps: int = 1,
                 reward_weights: list[float] | None = None, model_cfg: ModelConfig | None = None):
        self.swap, self.pctx, self.comm = swap, pctx, comm
        # A regression reward model's attribute weights: its reward is their weighted sum.
        self.reward_weights = torch.tensor(reward_weights, dtype=torch.float32) if reward_weights else None
        self.batching = batching   # micro-batches of infer and train (default: one, padded)
        self.value_clip = value_clip
        self.grad_clip = grad_clip   # global gradient norm of the value model (0: no clipping)
        self.checkpoint_dir = checkpoint_dir
        # A reward-only critic (no value model: GRPO family) trains nothing.
        self.optimizer = build_optimizer([p for c in swap.models[VALUE] for p in c.parameters()], pctx,
                                         training or TrainingConfig(),
                                         lr=lr, grad_clip=grad_clip, total_steps=total_steps,
                                         models=swap.models[VALUE]) \
            if VALUE in swap.models else None
        # The value model trains through the one model worker's step with the registered value loss.
        self.trainer = (ModelWorker.around(swap.models[VALUE], self.optimizer, pctx, model_cfg,
                                           batching=batching) if self.optimizer is not None else None)
        self.value_loss = ValueLoss(ValueOptions(value_clip=value_clip))
        self.holds_result = pctx.is_last_stage and pctx.tp_rank == 0

    def execute(self, cmd: Command) -> Any:
        """Run `cmd` (collective over the component); rank 0 gets the result, others None."""
        return getattr(self, f"_{cmd.kind}")(**cmd.data)

    def _rows(self, n: int) -> slice:
        bounds = np.linspace(0, n, self.pctx.dp_size + 1).round().astype(int)
        return slice(int(bounds[self.pctx.dp_rank]), int(bounds[self.pctx.dp_rank + 1]))

    def _gather_rows(self, part: Any) -> list | None:
        quiet.barrier(self.comm)   # DP ranks end their rows at different times: wait asleep
        parts = self.comm.gather((self.pctx.dp_rank, part) if self.holds_result else None, root=0)
        if parts is None:
            return None
        return [p for _, p in sorted((p for p in parts if p is not None), key=lambda x: x[0])]

    def _shutdown(self) -> None:
        return None

    @torch.no_grad()
    def _infer(self, tokens: np.ndarray, lengths: np.ndarray):
        rows = self._rows(tokens.shape[0])
        tok = torch.from_numpy(tokens[rows])
        out = {}
        if tok.shape[0]:
            for name in self.swap.order_for_infer():
                chunks = self.swap.use(name)
                for c in chunks:
                    c.eval()
                labels = len(self.reward_weights) if name == REWARD and self.reward_weights is not None else 1
                out[name] = forward_values(chunks, self.pctx, tok, lengths=torch.from_numpy(lengths[rows]),
                                           batching=self.batching, num_labels=labels)
        part = None
        if self.holds_result and tok.shape[0]:
            rewards = last_token_values(out[REWARD], torch.from_numpy(lengths[rows]))
            if self.reward_weights is not None:   # [b, attributes] -> the weighted sum [b]
                rewards = rewards @ self.reward_weights
            values = out[VALUE] if VALUE in out else torch.zeros(out[REWARD].shape[:2])  # reward-only: no values
            part = (values.numpy().astype(np.float32), rewards.numpy().astype(np.float32))
        parts = self._gather_rows(part)
        if parts is None:
            return None
        parts = [p for p in parts if p is not None]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _train(self, tokens, lengths, returns, prev_values, mask) -> float | None:
        """One step of the value model through the model worker (losses/value.py): this DP
        rank's rows, normalised by the masked positions of the whole batch."""
        assert self.trainer is not None, "only a critic with a value model trains"
        self.swap.use(VALUE)   # the value model on the device (the worker trains its chunks)
        rows = self._rows(tokens.shape[0])
        data = ValueTargets(torch.from_numpy(tokens), torch.from_numpy(lengths).long(),
                            {"returns": torch.from_numpy(returns), "prev": torch.from_numpy(prev_values),
                             "mask": torch.from_numpy(mask)})
        metrics = self.trainer.train(data, list(range(rows.start, rows.stop)), self.value_loss)
        return metrics["loss"] if self.comm.Get_rank() == 0 else None

    def _save(self, path: str) -> str | None:
        """The value model's full weights to `path`. For `iter_<step>.pt` (the actor's
        checkpoints) first the resumable state beside it, iter_<step>/: sharded weights, AdamW
        state and RNG, so a resumed run trains on as the uninterrupted one would."""
        target = Path(path)
        if not target.is_absolute():
            target = self.checkpoint_dir / target
        step = checkpoint_step(target)
        if step is not None:
            save_checkpoint(target.parent, step, self.swap.use(VALUE), self.optimizer, {"role": "critic"})
        full = full_state_dict(self.swap.use(VALUE), self.pctx, to_all=False)
        written = None
        if self.comm.Get_rank() == 0:
            written = str(save_atomic_torch(full, target))
        quiet.barrier(self.comm)  # every rank returns only once the file is durable
        return written

    def load_training_state(self, path: Path) -> int:
        """Collective: weights, optimizer state and RNG from a folder written by `_save`;
        returns its step."""
        common = load_checkpoint(path, self.swap.use(VALUE), self.optimizer)
        torch.set_rng_state(common["rng"])
        return int(common["step"])


def checkpoint_step(path: Path) -> int | None:
    """`iter_0000012.pt` -> 12 (a checkpoint of the actor's step); other names -> None."""
    m = _ITER_FILE.match(path.name)
    return int(m.group(1)) if m else None
