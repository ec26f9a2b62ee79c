"""Value and reward model on the same devices: one resident at a time, swapped via host memory.

infer needs both models, train only the value model. `order_for_infer` runs the resident
model first, so an infer costs exactly one swap (never two), and the infer before a train
that happened to end on the reward model costs the train one swap. With
`keep_resident=True` (switches.keep_critic_models_resident) both stay on the device and
nothing is ever swapped.
"""

from __future__ import annotations

from slurm_align.models.weights import HostSwap

VALUE, REWARD = "value", "reward"


class ModelSwap:
    def __init__(self, models: dict[str, list], *, keep_resident: bool, resident: str = VALUE):
        if set(models) not in ({VALUE, REWARD}, {REWARD}):
            raise ValueError(f"ModelSwap needs models {VALUE!r} and {REWARD!r} (or {REWARD!r} alone, for a "
                             f"reward-only critic); got {sorted(models)}")
        self.models = models
        # A reward-only critic (GRPO family with a reward model) has nothing to swap with.
        keep_resident = keep_resident or len(models) == 1
        self.keep_resident = keep_resident
        self.swaps = 0
        """Swaps performed so far (each offloads one model and onloads the other)."""
        self._host: dict[str, HostSwap] = {}
        self.resident = resident
        if not keep_resident:
            self._host = {name: HostSwap(chunks) for name, chunks in models.items()}
            other = REWARD if resident == VALUE else VALUE
            self._host[other].offload()

    def is_resident(self, name: str) -> bool:
        return self.keep_resident or self.resident == name

    def use(self, name: str) -> list:
        """The chunks of `name`, on the device (swapping the other model out if needed)."""
        if not self.is_resident(name):
            self._host[self.resident].offload()
            self._host[name].onload()
            self.resident = name
            self.swaps += 1
        return self.models[name]

    def order_for_infer(self) -> tuple[str, str]:
        """Resident model first: one swap per infer."""
        if len(self.models) == 1:
            return (REWARD,)
        if self.keep_resident or self.resident == REWARD:
            return (REWARD, VALUE)
        return (VALUE, REWARD)
