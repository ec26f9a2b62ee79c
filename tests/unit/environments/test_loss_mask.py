"""The loss mask of a multi-turn trajectory, on a hand-built two-turn conversation: the layout,
and that the policy loss, KL and value loss over the masked trajectory equal those over the
model's tokens alone, with no gradient through the predictions of the tool's tokens."""

from __future__ import annotations

import torch

from slurm_align.algorithms.policy_loss import LossTerms, aggregate, clipped_policy_loss
from slurm_align.data.positions import gather_response, scatter_positions
from slurm_align.environments.loss_mask import Turn, build_trajectory, loss_mask_tensor, position_loss_mask

EOS = 2
PROMPT = [5, 6, 7]
TURNS = [Turn("model", [10, 11, 12]),       # a model turn ending in a tool call
         Turn("tool", [20, 21]),            # the tool's answer: context only
         Turn("env", []),                   # an environment with nothing to say takes no place
         Turn("model", [13, 14, EOS])]      # the model's answer


def test_layout_of_a_two_turn_trajectory():
    traj = build_trajectory(PROMPT, TURNS)
    assert traj.tokens == [5, 6, 7, 10, 11, 12, 20, 21, 13, 14, EOS]
    assert traj.prompt_length == 3 and traj.response_length == 8 and traj.model_tokens == 6
    assert traj.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    assert traj.turn_starts == [0, 3, 5] and traj.turn_roles == ["model", "tool", "model"]
    # the outputs at positions 2..4 and 7..9 predict the model's tokens; 5 and 6 the tool's
    assert position_loss_mask(traj) == [0, 0, 1, 1, 1, 0, 0, 1, 1, 1]
    # the same as RolloutBatch's own response -> position mapping gives
    mask = loss_mask_tensor([traj])
    assert scatter_positions(mask, torch.tensor([3]), torch.tensor([8]), 10)[0].tolist() == position_loss_mask(traj)
    short = build_trajectory([1], [Turn("model", [3])])
    assert loss_mask_tensor([traj, short]).tolist()[1] == [1, 0, 0, 0, 0, 0, 0, 0]


class Tiny(torch.nn.Module):
    """A causal toy model: each position sees the mean of the embeddings up to it, so the tool's
    tokens are context for the model's second turn."""

    def __init__(self, vocab: int = 32, width: int = 8):
        super().__init__()
        self.emb, self.head, self.value = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab), \
            torch.nn.Linear(width, 1)

    def forward(self, tokens: torch.Tensor):
        e = self.emb(tokens)
        h = e.cumsum(1) / torch.arange(1, tokens.shape[1] + 1).view(1, -1, 1)
        return self.head(h), self.value(h)[..., 0]


def losses(mask_kind: str):
    torch.manual_seed(0)
    model = Tiny()
    traj = build_trajectory(PROMPT, TURNS)
    tokens = torch.tensor([traj.tokens])
    logits, values = model(tokens)
    logits.retain_grad()
    values.retain_grad()
    logp_pos = torch.log_softmax(logits[:, :-1], -1).gather(2, tokens[:, 1:, None])[..., 0]     # [1, L-1]
    p, n, T = torch.tensor([traj.prompt_length]), torch.tensor([traj.response_length]), traj.response_length
    logp, v = gather_response(logp_pos, p, n, T), gather_response(values, p, n, T)
    g = torch.Generator().manual_seed(1)
    old = logp.detach() + 0.1 * torch.randn(1, T, generator=g)
    ref = logp.detach() + 0.2 * torch.randn(1, T, generator=g)
    adv, ret = torch.randn(1, T, generator=g), torch.randn(1, T, generator=g)
    terms = LossTerms(kl_loss_coef=0.1)
    if mask_kind == "alone":       # the model's tokens only, nothing masked
        idx = torch.tensor([t for t, m in enumerate(traj.loss_mask) if m])
        logp, v, old, ref, adv, ret = (x[:, idx] for x in (logp, v, old, ref, adv, ret))
        mask = torch.ones(1, len(idx))
    else:
        mask = torch.ones(1, T) * (loss_mask_tensor([traj]) if mask_kind == "masked" else 1.0)
    policy, stats = clipped_policy_loss(logp, old, adv, mask, terms, ref_logp=ref)
    value = aggregate((v - ret) ** 2, mask, "token-mean")
    (policy + value).backward()
    return policy, value, stats, logits.grad[0], values.grad[0], traj


def test_losses_equal_those_on_the_models_tokens_alone():
    p_masked, v_masked, s_masked, *_ = losses("masked")
    p_alone, v_alone, s_alone, *_ = losses("alone")
    torch.testing.assert_close(p_masked, p_alone)
    torch.testing.assert_close(v_masked, v_alone)
    assert abs(s_masked.kl - s_alone.kl) < 1e-6 and s_masked.kl > 0 and s_masked.tokens == s_alone.tokens == 6


def test_tool_tokens_get_no_gradient():
    *_, logit_grad, value_grad, traj = losses("masked")
    predicts = position_loss_mask(traj)
    tool_positions = [p for p in range(traj.prompt_length - 1, len(predicts)) if not predicts[p]]
    assert tool_positions == [5, 6]
    for p in tool_positions:                   # the outputs that predict the tool's tokens
        assert torch.count_nonzero(logit_grad[p]) == 0 and value_grad[p] == 0
    for p in (2, 3, 4, 7, 8, 9):              # the model's tokens do get gradients
        assert torch.count_nonzero(logit_grad[p]) > 0 and value_grad[p] != 0
    # without the loss mask the tool's tokens would be trained: the check can fail
    *_, unmasked_grad, unmasked_value_grad, _ = losses("unmasked")
    assert all(torch.count_nonzero(unmasked_grad[p]) > 0 and unmasked_value_grad[p] != 0 for p in tool_positions)
