"""Phase names of a PPO step and the span record schema, written down once.

Every timed span on every rank carries one of these names, so the breakdown, the Chrome-trace
export and the ablation views agree on them. New phases may be added here; readers keep any
unknown name they find in a store (it is shown as-is), so older analysis code still works.
"""

from __future__ import annotations

import numpy as np

# Actor side (DESIGN.md, "Data flow of one PPO step").
REFIT = "refit"
GENERATE = "generate"
LOGPROBS = "logprobs"
INIT_LOGPROBS = "init_logprobs"
CRITIC_WAIT = "critic_wait"
REBALANCE = "rebalance"
STORE = "store"
TRAIN = "train"
# Critic side.
CRITIC_INFER = "critic_infer"
CRITIC_TRAIN = "critic_train"
# Prompt server: time a generation worker waits for its next prompt batch.
PROMPT_WAIT = "prompt_wait"
# Held-out task evaluation after a step (refit + greedy generation + scoring; eval.interval).
EVALUATE = "evaluate"
# Disaggregated rollouts: the trainer gathering and streaming its weights after a step, and the
# generator waiting for and applying them before one.
WEIGHT_SYNC = "weight_sync"
# Multi-turn rollouts: the environment's steps between the model's turns (tool calls in its pool).
TOOLS = "tools"
# A checkpoint save's time on the step's critical path (all of it, or with checkpointing.async_save
# the planning and the host copy).
SAVE = "save"

PHASES: tuple[str, ...] = (
    REFIT, GENERATE, TOOLS, LOGPROBS, INIT_LOGPROBS, CRITIC_WAIT, REBALANCE, STORE, TRAIN,
    CRITIC_INFER, CRITIC_TRAIN, PROMPT_WAIT, EVALUATE, WEIGHT_SYNC, SAVE,
)
"""Known phases in the order a step runs them (the order of table rows and bar segments)."""

IDLE = "idle"
"""Derived by the breakdown (step time minus a rank's busy spans); never recorded as a span."""

SPAN_DTYPE = np.dtype([
    ("step", np.int64),        # PPO step the span belongs to
    ("phase", "U32"),          # one of PHASES (or a newer name)
    ("start_ns", np.int64),    # wall clock (time.time_ns base + perf_counter_ns offsets)
    ("end_ns", np.int64),
    ("rank", np.int32),        # rank inside its component's MPI world
    ("component", "U16"),      # "actor", "critic", ...
])
"""One span as readers return it (a numpy structured array of these is a span table)."""


def phase_order(names) -> list[str]:
    """Known phases first in step order, then any other names sorted, then idle last."""
    names = set(names)
    known = [p for p in PHASES if p in names]
    other = sorted(n for n in names if n not in PHASES and n != IDLE)
    return known + other + ([IDLE] if IDLE in names else [])
