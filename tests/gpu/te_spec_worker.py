"""GPU program for tests/unit/models/test_te_names.py and gpu_checks.py (not a test): the same model built on
CUDA with the Transformer Engine layer spec and with megatron's local spec, same seed, has the
same full state dict (shared naming, models/te_names.py) and the same logits. Prints TE_SPEC_OK.

    python tests/gpu/te_spec_worker.py

One process, no MPI (the GPU machine has no launcher): torch.distributed is started on a
single-rank store (gpu_checks.SoloEnv). The models are float32 (gpt.transformer_config), whose
default spec is the local one (gpt.layer_spec): the TE model is built with gpt.te_layer_spec put
in its place, and compared on padded batches (TE's fp32 attention runs those; packed THD input it
runs in fp16/bf16 only).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # run as a script: the checkout first


@contextlib.contextmanager
def spec_of(choose: Callable) -> Iterator[None]:
    """gpt.build_gpt with `choose` as its layer spec (called as build_gpt calls gpt.layer_spec:
    with the ModelConfig and the parameters' dtype)."""
    from slurm_align.models import gpt

    real = gpt.layer_spec
    gpt.layer_spec = lambda model_cfg, params_dtype=torch.float32: choose(model_cfg)
    try:
        yield
    finally:
        gpt.layer_spec = real


def main() -> None:
    from slurm_align.config.run import ModelConfig
    from slurm_align.models import gpt
    from slurm_align.models.forward import model_inputs
    from slurm_align.models.weights import full_state_dict
    from slurm_align.parallel.layout import initialize_model_parallel
    from tests.gpu.gpu_checks import SoloEnv

    torch.cuda.set_device(0)
    pctx = initialize_model_parallel(SoloEnv(torch.device("cuda")), 1, 1)
    tokens = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0)).cuda()
    for cfg in (ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=200, max_seq_len=32),
                ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=200,
                            max_seq_len=32, position_embedding="rope", normalization="RMSNorm", activation="swiglu",
                            add_bias_linear=False, add_qkv_bias=True)):
        with spec_of(gpt.te_layer_spec):
            te_model = gpt.build_gpt(cfg, pctx, seed=3)[0]
        names = list(te_model.state_dict())
        assert any(n.endswith("linear_qkv.layer_norm_weight") for n in names), "not built with the TE spec"
        with spec_of(gpt.local_layer_spec):
            local_model = gpt.build_gpt(cfg, pctx, seed=3)[0]
        a, b = full_state_dict([te_model], pctx), full_state_dict([local_model], pctx)
        assert list(a) == list(b), (list(a)[:6], list(b)[:6])
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
        with torch.no_grad():
            la, lb = te_model(**model_inputs(tokens)), local_model(**model_inputs(tokens))
        err = (la - lb).abs().max().item()
        assert err < 1e-3 * max(1.0, lb.abs().max().item()), err
        print(f"TE_SPEC_OK {cfg.normalization} {cfg.activation} max_logit_diff={err:.2e}", flush=True)
    pctx.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
