"""The RL actor's losses over rollouts (algorithms/policy_gradient.PolicyUpdate trains with them
through the model worker's step, models/worker.py):

- `PolicyLoss` ('policy'): the run's registered per-token policy loss (RunConfig.loss, kind
  'policy': ppo_clip's clipped surrogate, a plugin's GSPO, ...; same arguments as
  algorithms.policy_loss.clipped_policy_loss) on the policy's log-probs at the sampling
  temperature, with the KL loss term, the entropy bonus and the rollout-correction weights;
- `RolloutNLL` ('rollout_nll'): rejection sampling's SFT on the kept samples.

Both count the response tokens of samples that ended (is_end) and are kept ('train'): the
micro-batch column "weight" (PolicyUpdate sets it). The normaliser is the loss aggregation's
denominator (tokens, or sequences) over the whole optimizer batch and every DP rank, so the
gradient does not depend on how the batch is cut into micro-batches.

They live here, not in slurm_align/losses/, because they wrap the algorithms' own policy-loss
math (policy_loss.py, rollout_correction.py), which the packages below the algorithms must not
import (tests/unit/test_layering.py); the loss registry names them by their import path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from slurm_align.algorithms import rollout_correction
from slurm_align.algorithms.policy_loss import LossTerms, aggregate, denominator
from slurm_align.data.positions import gather_response
from slurm_align.losses.base import Loss
from slurm_align.models.forward import per_sequence, sequence_token_logprobs

ROLLOUT_COLUMNS = ("tokens", "mask", "prompt_lengths", "response_lengths", "weight")
"""What every rollout micro-batch holds (RolloutBatch.micro_batches) that these losses read."""


class RolloutNLL(Loss):
    """Negative log-likelihood of the kept samples' response tokens (temperature 1), averaged
    over every counted token of the optimizer batch."""

    name = "rollout_nll"
    columns: ClassVar[tuple[str, ...]] = ROLLOUT_COLUMNS
    sum_keys: ClassVar[tuple[str, ...]] = ("loss", "tokens")
    temperature = 1.0

    def counted(self, mb: dict) -> torch.Tensor:
        """[b, T]: 1 on the response tokens that count (kept samples that ended)."""
        return mb["mask"] * mb["weight"][:, None]

    def count(self, mb: dict) -> float:
        return float(self.counted(mb).sum())

    def response_logprobs(self, output: torch.Tensor, mb: dict) -> torch.Tensor:
        """[b, T] log-probs of the response tokens at this loss's temperature."""
        return gather_response(sequence_token_logprobs(output, mb, self.vocab_size, self.temperature),
                               mb["prompt_lengths"], mb["response_lengths"], mb["mask"].shape[1])

    def __call__(self, output, mb):
        mask = self.counted(mb).to(output.device)
        loss = aggregate(-self.response_logprobs(output, mb), mask, "token-mean", mb["norm"])
        return loss, {"loss": loss.detach(), "tokens": mask.sum()}

    def metrics(self, s):
        """The step's loss and counted tokens (PolicyUpdate adds them up over its steps)."""
        return {k: float(s[k]) for k in self.sum_keys}


class PolicyLoss(RolloutNLL):
    """The registered per-token policy loss `fn` (kind 'policy') behind the worker's Loss
    interface. Metric sums: loss (the optimizer batch's), and ratio, clipped and kl weighted by
    the counted tokens (means: divide by 'tokens')."""

    name = "policy"
    columns: ClassVar[tuple[str, ...]] = (*ROLLOUT_COLUMNS, "logprobs", "ref_logprobs", "advantages")
    optional_columns: ClassVar[tuple[str, ...]] = (rollout_correction.WEIGHTS,)
    sum_keys: ClassVar[tuple[str, ...]] = ("loss", "ratio", "clipped", "kl", "tokens")

    def __init__(self, options: Any, model: Any, *, fn: Callable[..., tuple[torch.Tensor, Any]],
                 terms: LossTerms, temperature: float):
        super().__init__(options, model)
        self.fn, self.terms, self.temperature = fn, terms, temperature

    def count(self, mb: dict) -> float:
        return denominator(self.counted(mb), self.terms.agg)

    def __call__(self, output, mb):
        dev = output.device
        mask = self.counted(mb).to(dev)
        logp = self.response_logprobs(output, mb)
        entropy = self.entropy(output, mb) if self.terms.entropy_coef > 0 else None
        rc = mb[rollout_correction.WEIGHTS].to(dev) if rollout_correction.WEIGHTS in mb else None
        loss, st = self.fn(logp, mb["logprobs"].to(dev), mb["advantages"].to(dev), mask, self.terms,
                           ref_logp=mb["ref_logprobs"].to(dev), entropy=entropy, norm=mb["norm"], weights=rc,
                           options=self.options)
        sums = {"loss": st.loss, "ratio": st.ratio * st.tokens, "clipped": st.clipped_fraction * st.tokens,
                "kl": st.kl * st.tokens, "tokens": st.tokens}
        return loss, {k: torch.tensor(float(v), dtype=torch.float64) for k, v in sums.items()}

    def entropy(self, output: torch.Tensor, mb: dict) -> torch.Tensor:
        """Entropy of the policy at each response token's predicting position, [b, T]."""
        logits = gather_from_tensor_model_parallel_region(output)[..., :self.vocab_size]
        lp_all = torch.log_softmax(logits.float() / self.temperature, -1)
        per_position = per_sequence(-(lp_all.exp() * lp_all).sum(-1), mb)
        return gather_response(per_position, mb["prompt_lengths"], mb["response_lengths"], mb["mask"].shape[1])
