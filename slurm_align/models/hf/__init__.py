"""Hugging Face models in and out: config mapping (config.py), tensor names and layouts
(mapping.py), streaming import from safetensors (loader.py) and export (exporter.py).

Why our own mapping and not mbridge (the Megatron<->HF bridge veRL uses): measured on these
machines (../../shared/STACK.md), mbridge 0.15.1 hard-codes the Transformer Engine layer spec
(`get_model` fails without TE: `NameError: TENorm`) and maps onto TE's parameter names, so on
CPU it needs a subclass plus a name translation; its loader also reads every tensor on TP rank 0
and scatters, so rank 0's host memory holds whole tensors, against our goal of each rank reading
only its slices. The four architectures here (Llama, Qwen2, Mistral, GPT-2) differ in a handful
of names and layouts, which mapping.py states in one table, tested against transformers.
"""
