"""A multi-turn trajectory as one token sequence with a per-token loss mask.

    traj = build_trajectory(prompt_ids, [Turn("model", a), Turn("env", tool_out), Turn("model", b)])
    traj.tokens        prompt, then every turn's tokens, in order (what the model is run over)
    traj.loss_mask     one entry per token after the prompt: 1 for the model's own tokens, 0 for
                       the environment's (tool outputs, user turns): in the context, not trained

It fits RolloutBatch's layout: the "response" is everything after the prompt (response_length =
len(loss_mask)), and the loss mask is one more per-response-token column, multiplied into the
response mask for the policy loss, the KL, the value loss and the response-length statistics
(model_tokens). Response token t is sequence position prompt_length + t; the output that
predicts it is at position prompt_length + t - 1 (position_loss_mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MODEL = "model"
"""The role whose tokens are trained; every other role (tool, user, env) is the environment's."""


@dataclass(frozen=True)
class Turn:
    role: str
    """"model" for a model turn; anything else ("tool", "user", "env") is not trained."""
    tokens: Sequence[int]


@dataclass(frozen=True)
class Trajectory:
    tokens: list[int]
    prompt_length: int
    loss_mask: list[int]
    """Per token after the prompt: 1 trained (the model's), 0 context only (the environment's)."""
    turn_starts: list[int]
    """Index (after the prompt) where each turn starts."""
    turn_roles: list[str]

    @property
    def response_length(self) -> int:
        return len(self.loss_mask)

    @property
    def model_tokens(self) -> int:
        """The model's tokens: what response-length statistics count."""
        return sum(self.loss_mask)


def build_trajectory(prompt: Sequence[int], turns: Sequence[Turn]) -> Trajectory:
    """The trajectory of a conversation: the prompt's tokens and its turns' tokens, in order."""
    if not prompt:
        raise ValueError("a trajectory needs a prompt of at least one token (the first prediction's context)")
    tokens: list[int] = [int(t) for t in prompt]
    mask: list[int] = []
    starts: list[int] = []
    roles: list[str] = []
    for turn in turns:
        if not turn.tokens:
            continue            # an empty turn (an environment with nothing to say) takes no place
        starts.append(len(mask))
        roles.append(turn.role)
        tokens += [int(t) for t in turn.tokens]
        mask += [1 if turn.role == MODEL else 0] * len(turn.tokens)
    return Trajectory(tokens, len(prompt), mask, starts, roles)


def position_loss_mask(traj: Trajectory, width: int | None = None) -> list[int]:
    """Per sequence position (width default len(tokens) - 1, the next-token outputs): 1 where the
    output predicts a model token."""
    width = len(traj.tokens) - 1 if width is None else width
    out = [0] * width
    for t, m in enumerate(traj.loss_mask):
        p = traj.prompt_length + t - 1
        if m and p < width:
            out[p] = 1
    return out


def loss_mask_tensor(trajectories: Sequence[Trajectory], T: int | None = None) -> torch.Tensor:
    """[B, T] float32 over response tokens (RolloutBatch's per_token layout), 0 on padding."""
    T = max((t.response_length for t in trajectories), default=0) if T is None else T
    out = torch.zeros(len(trajectories), T, dtype=torch.float32)
    for i, traj in enumerate(trajectories):
        n = min(T, traj.response_length)
        out[i, :n] = torch.tensor(traj.loss_mask[:n], dtype=torch.float32)
    return out
