"""The DPO family on (chosen, rejected) pairs against the frozen reference policy: dpo (with
cDPO label smoothing), scale, ipo, rpo_sq, rpo_fwd_kl, rpo_bwd_kl, plus an SFT term on the
chosen response (losses/registry.py PreferenceOptions documents each formula)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slurm_align.losses.base import Loss, sequence_logprobs
from slurm_align.losses.registry import PreferenceOptions


def preference_terms(policy: torch.Tensor, reference: torch.Tensor, rewards: torch.Tensor,
                     opts: PreferenceOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair: (the preference loss [n], the margin r [n]). `policy`, `reference`: sequence
    log-probs [2n] (chosen, then rejected); `rewards`: the rows' ground-truth rewards [2n]."""
    pc, pr = policy.chunk(2)
    rc, rr = reference.chunk(2)
    beta = opts.beta
    r = beta * ((pc - rc) - (pr - rr))
    chosen_reward, rejected_reward = rewards.to(r).chunk(2)
    g = (chosen_reward - rejected_reward) * opts.gt_reward_scale
    kind = opts.preference_loss
    if kind == "dpo":
        eps = opts.label_smoothing
        loss = -(1 - eps) * F.logsigmoid(r) - eps * F.logsigmoid(-r)
    elif kind == "scale":
        loss = (chosen_reward - rejected_reward).abs() * -F.logsigmoid(r)
    elif kind == "ipo":
        loss = (r / beta - 1 / (2 * beta)) ** 2
    elif kind == "rpo_sq":
        loss = (r - g) ** 2
    elif kind == "rpo_bwd_kl":   # KL(sigma(g) || sigma(r)) over the two outcomes
        loss = (torch.sigmoid(g) * (F.logsigmoid(g) - F.logsigmoid(r))
                + torch.sigmoid(-g) * (F.logsigmoid(-g) - F.logsigmoid(-r)))
    elif kind == "rpo_fwd_kl":   # KL(sigma(r) || sigma(g))
        loss = (torch.sigmoid(r) * (F.logsigmoid(r) - F.logsigmoid(g))
                + torch.sigmoid(-r) * (F.logsigmoid(-r) - F.logsigmoid(-g)))
    else:
        raise ValueError(f"unknown preference_loss {kind!r}")
    return loss, r


class Preference(Loss):
    name = "preference"
    pairs = True
    reference = True
    columns = ("tokens", "lengths", "mask", "real", "rewards")

    options: PreferenceOptions

    def __call__(self, output, mb):
        opts = self.options
        token_logp = self.token_logprobs(output, mb)
        mask = mb["mask"].to(token_logp.device)
        policy = sequence_logprobs(token_logp, mask, opts.average_log_probs)
        reference = sequence_logprobs(mb["ref_logp"].to(token_logp.device), mask, opts.average_log_probs)
        defaults = torch.tensor([opts.default_chosen_reward, opts.default_rejected_reward]).repeat_interleave(
            len(mb["real"]))
        rewards = mb["rewards"].to(torch.float64)
        rewards = torch.where(torch.isnan(rewards), defaults.to(rewards), rewards)
        pref, r = preference_terms(policy, reference, rewards, opts)
        # the SFT term: the chosen response's mean token NLL (always averaged, whatever average_log_probs)
        sft = -sequence_logprobs(token_logp, mask, average=True).chunk(2)[0]
        real = mb["real"].to(r.device)
        per_pair = opts.preference_weight * pref + opts.sft_weight * sft
        loss_sum = (per_pair * real).sum()
        pc, _ = (policy - reference).chunk(2)
        return loss_sum / mb["norm"], {
            "loss_sum": loss_sum.detach(), "preference_loss_sum": (pref.detach() * real).sum(),
            "sft_loss_sum": (sft.detach() * real).sum(), "margin_sum": (r.detach() * real).sum(),
            "correct": ((r > 0).float() * real).sum(), "pairs": real.sum(),
            "chosen_reward_sum": (opts.beta * pc.detach() * real).sum()}

    def metrics(self, s):
        n = s["pairs"].clamp(min=1)
        return {"loss": float(s["loss_sum"] / n), "preference_loss": float(s["preference_loss_sum"] / n),
                "sft_loss": float(s["sft_loss_sum"] / n), "reward_margin": float(s["margin_sum"] / n),
                "accuracy": float(s["correct"] / n), "chosen_reward": float(s["chosen_reward_sum"] / n)}
