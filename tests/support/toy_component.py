"""A toy component kind registered from outside the library, as a user's plugin module would: a
run that lists this module under `plugins:` declares a `toy` component beside its actor. Its
ranks run tests/programs/toy_component.py, which serves a secret-checked echo and publishes its
address (tests/integration/test_components.py). Not a test."""

from __future__ import annotations

import hashlib
import hmac

from slurm_align.config.components import ComponentKind, register_component, rollout_job

MODULE = __name__

TOY = register_component(ComponentKind(
    "toy", "tests.programs.toy_component",
    declared_by=lambda run: rollout_job(run) and MODULE in run.plugins,
    serves=True, preemption="survives", lost_peer=r"ToyLost: "))


def token(secret: str) -> str:
    """What a client proves it holds the run's secret with (the secret itself never travels)."""
    return hmac.new(secret.encode(), b"toy-ping", hashlib.sha256).hexdigest()
