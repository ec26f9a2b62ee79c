"""Offline knowledge distillation (NeMo-Aligner's SFT with knowledge distillation): the student
trains on responses with the teacher's stored top-K next-token log-probs (`slurm-align generate
--top-k-logprobs K`, algorithms/generate.py). At each response position, over the teacher's K
tokens, both distributions renormalised over those K:

    q_k = softmax_K(teacher log-probs),   p_k = softmax_K(student log-probs at the same ids)
    KL(q || p) = sum_k q_k (log q_k - log p_k)                    (forward KL, mean over tokens)
    loss = kd_weight * KL + sft_weight * NLL(response tokens)     (losses/registry.py KDOptions)

Renormalising over the K ids makes the loss blind to the mass outside them (for teacher and
student alike): the student's mass outside the teacher's K ids is free to grow, and does
(tests/integration/test_offline_distillation.py measured a student keeping 17% of its mass on
the teacher's top-8, where the teacher keeps 98%; its greedy answers are fine, its samples are
not). With `rest_mass` the KL is over K+1 classes, the K ids and the rest of the vocabulary,
none renormalised (q_rest = 1 - sum_k exp(teacher log-prob_k), from the stored values; p_rest the
student's mass outside the K ids), so the student matches how much mass the teacher leaves
outside them too. The student's full-vocabulary log-softmax (TP-gathered) is taken first, so
the softmax over K equals softmax_K of its logits.

Data: generate's rows ({"prompt_ids", "response_ids", "topk_ids", "topk_logprobs"}), from one
data file (any format of data/sources.py), generate's output folder of shard_*.jsonl files, or a
data.mixture of them; the token ids are used as stored (no re-tokenisation), cut to max_len with
their top-K. Rows are read and checked when first used (as the other data sets read theirs,
data/jsonl.LazyRows): a rank reads its own share, and a bad row is an error naming its file and
line when it is read.
"""

from __future__ import annotations

import collections.abc
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from slurm_align.config.errors import ConfigError
from slurm_align.data.datasets import Sequence, pad, response_mask
from slurm_align.data.mixture import MixedRows, MixtureSpec
from slurm_align.data.sources import open_source
from slurm_align.losses.base import Loss
from slurm_align.losses.registry import KDOptions
from slurm_align.models.forward import per_sequence

KEYS = ("prompt_ids", "response_ids", "topk_ids", "topk_logprobs")
KIND = "distillation"


class _Rows(collections.abc.Sequence):
    """Positions of a data file or of generate's shard folder (its files in shard order): row i
    read on use, with its file and where it is in it ('line N')."""

    def __init__(self, path: Path, columns: Mapping[str, str] | None):
        shards = path.is_dir() and not (path / "state.json").exists()
        files = sorted(path.glob("shard_*.jsonl")) if shards else [path]
        if not files:
            raise ConfigError(["distillation data: a folder without shard_*.jsonl files (slurm-align generate's "
                               "output) or datasets' state.json"], path)
        self.sources = [open_source(f, KIND, columns) for f in files]
        self.starts = np.cumsum([0] + [len(src) for src in self.sources])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> tuple[Path, str, Any]:  # type: ignore[override]  # ints only
        f = int(np.searchsorted(self.starts, i, side="right")) - 1
        src, k = self.sources[f], i - int(self.starts[f])
        return src.path, f"{src.unit} {src.number(k)}", src.record(k)


class DistillDataset:
    """Teacher-labelled responses: batch() gives tokens, lengths, the response mask and, aligned
    with the mask ([n, s-1]: position p predicts token p+1), "topk_ids" [n, s-1, K] and
    "topk_logprobs" [n, s-1, K] (0 off the response). `path`: a data file, generate's output
    folder, or a data/mixture.py MixtureSpec. K is the first row's; every row must have it."""

    def __init__(self, path: Any, tok, max_len: int, columns: Mapping[str, str] | None = None):
        self.pad_id, self.max_len = tok.pad_id, max_len
        self.path = Path(getattr(path, "path", path))
        self.rows: _Rows | MixedRows[tuple[Path, str, Any]] = (
            path.over([_Rows(Path(p), cols or columns) for p, _, cols in path.sources])
            if isinstance(path, MixtureSpec) else _Rows(path, columns))
        if not len(self.rows):
            raise ConfigError(["distillation data: no rows"], self.path)
        self._items: dict[int, tuple[Sequence, np.ndarray, np.ndarray]] = {}
        self.k = 0
        self.k = int(self._item(0)[1].shape[1])   # the first row sets K (and a wrong file fails now)

    def _item(self, i: int) -> tuple[Sequence, np.ndarray, np.ndarray]:
        """Row i as (its tokens cut to max_len, its top-K ids, its top-K log-probs), read and checked once."""
        got = self._items.get(i)
        if got is not None:
            return got
        path, where, obj = self.rows[i]
        missing = [k for k in KEYS if not isinstance(obj, dict) or obj.get(k) is None]
        if missing:
            found = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ConfigError([f"{where}: no {missing} (found {found}); write the data with "
                               "`slurm-align generate --top-k-logprobs K`"], path)
        prompt, resp = list(obj["prompt_ids"]), list(obj["response_ids"])
        ids, lps = np.asarray(obj["topk_ids"], dtype=np.int64), np.asarray(obj["topk_logprobs"], dtype=np.float32)
        if ids.shape != lps.shape or ids.ndim != 2 or len(ids) != len(resp) or not prompt:
            raise ConfigError([f"{where}: topk_ids {ids.shape} and topk_logprobs {lps.shape} must both be "
                               f"[len(response_ids)={len(resp)}, K], with a non-empty prompt"], path)
        if self.k and ids.shape[1] != self.k:
            raise ConfigError([f"{where}: K={ids.shape[1]}, the first row has K={self.k} (one generate job's "
                               "output)"], path)
        keep = max(0, min(len(resp), self.max_len - len(prompt)))
        got = self._items[i] = (Sequence(prompt + resp[:keep], len(prompt)), ids[:keep], lps[:keep])
        return got

    def item(self, i: int) -> Sequence:
        return self._item(i)[0]

    def __len__(self) -> int:
        return len(self.rows)

    def item_tokens(self, indices: list[int]) -> np.ndarray:
        return np.asarray([len(self.item(i).ids) for i in indices], dtype=np.int64)

    def batch(self, indices: list[int]) -> dict:
        got = [self._item(i) for i in indices]
        seqs = [s for s, _, _ in got]
        tokens, lengths = pad([s.ids for s in seqs], self.pad_id)
        width = tokens.shape[1] - 1
        ids = torch.zeros(len(seqs), width, self.k, dtype=torch.int64)
        lps = torch.zeros(len(seqs), width, self.k, dtype=torch.float32)
        for j, (s, tid, tlp) in enumerate(got):
            a = s.prompt_len - 1     # position a predicts the first response token
            ids[j, a:a + len(tid)] = torch.from_numpy(tid)
            lps[j, a:a + len(tlp)] = torch.from_numpy(tlp)
        return {"tokens": tokens, "lengths": lengths, "mask": response_mask(seqs, tokens.shape[1]),
                "topk_ids": ids, "topk_logprobs": lps}


def topk_forward_kl(student_logp: torch.Tensor, topk_ids: torch.Tensor, teacher_logp: torch.Tensor,
                    rest_mass: bool = False) -> torch.Tensor:
    """Per position [...]: KL(q || p) over the teacher's K ids, both renormalised over them.
    `student_logp` [..., V] (any normalisation), `topk_ids`, `teacher_logp` [..., K].
    rest_mass: over K+1 classes instead, the K ids and the rest of the vocabulary, unrenormalised:
    `student_logp` must then be normalised over the vocabulary (a log-softmax) and `teacher_logp`
    are the teacher's full-vocabulary log-probs as generate stores them."""
    s = student_logp.gather(-1, topk_ids)
    if rest_mass:
        # the student's rest: logsumexp over the ids outside the K (exact, no 1 - sum cancellation)
        outside = student_logp.scatter(-1, topk_ids, float("-inf"))
        log_p = torch.cat([s, torch.logsumexp(outside, -1, keepdim=True)], -1)
        # the teacher's rest: 1 - its K probabilities (stored values only), floored so that a
        # teacher whose K ids hold all the mass (to float precision) adds no term, not a NaN
        rest = (1 - teacher_logp.exp().sum(-1, keepdim=True)).clamp(min=1e-12)
        log_q = torch.cat([teacher_logp, rest.log()], -1)
    else:
        log_p = s - torch.logsumexp(s, -1, keepdim=True)
        log_q = teacher_logp - torch.logsumexp(teacher_logp, -1, keepdim=True)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


class KD(Loss):
    name = "kd"
    columns = ("tokens", "lengths", "mask", "real", "topk_ids", "topk_logprobs")

    options: KDOptions

    def dataset(self, path, tok, max_len: int, columns: Mapping[str, str] | None = None, truncate: bool = False):
        # generate's shards: responses are cut to what fits max_len with their prompt, as written
        return DistillDataset(path, tok, max_len, columns)

    def count(self, mb: dict) -> float:
        return float(mb["mask"].sum())   # response tokens (filler samples have mask 0)

    def __call__(self, output: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict[str, Any]]:
        logits = per_sequence(gather_from_tensor_model_parallel_region(output)[..., :self.vocab_size], mb)
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)      # [b, s-1, V], the trainers' op
        width = logp.shape[1]
        mask = mb["mask"][:, :width].to(logp.device)
        ids = mb["topk_ids"][:, :width].to(logp.device)
        kl = topk_forward_kl(logp, ids, mb["topk_logprobs"][:, :width].to(logp.device), self.options.rest_mass)
        nll = -self.token_logprobs(output, mb)[:, :width] if self.options.sft_weight else torch.zeros_like(kl)
        kl_sum, nll_sum = (kl * mask).sum(), (nll * mask).sum()
        loss_sum = self.options.kd_weight * kl_sum + self.options.sft_weight * nll_sum
        return loss_sum / mb["norm"], {"loss_sum": loss_sum.detach(), "kl_sum": kl_sum.detach(),
                                       "nll_sum": nll_sum.detach(), "tokens": mask.sum()}

    def metrics(self, s: dict) -> dict[str, float]:
        n = s["tokens"].clamp(min=1)
        return {"loss": float(s["loss_sum"] / n), "kl": float(s["kl_sum"] / n), "nll": float(s["nll_sum"] / n)}
