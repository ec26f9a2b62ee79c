"""GPU program for tests/unit/models/test_te_names.py (not a test): the same model built on CUDA with the
Transformer Engine layer spec and with megatron's local spec, same seed, has the same full
state dict (shared naming, models/te_names.py) and the same logits. Prints TE_SPEC_OK.

    python tests/gpu/te_spec_worker.py
"""

from __future__ import annotations

import torch


def main() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import slurm_align.models.gpt as gpt
    from slurm_align.config.run import ModelConfig
    from slurm_align.models.forward import model_inputs
    from slurm_align.models.weights import full_state_dict
    from slurm_align.parallel.bootstrap import init_distributed, shutdown_distributed
    from slurm_align.parallel.layout import initialize_model_parallel

    env = init_distributed()
    pctx = initialize_model_parallel(env, 1, 1)
    tokens = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0)).cuda()
    for cfg in (ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=200, max_seq_len=32),
                ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=200,
                            max_seq_len=32, position_embedding="rope", normalization="RMSNorm", activation="swiglu",
                            add_bias_linear=False, add_qkv_bias=True)):
        te_model = gpt.build_gpt(cfg, pctx, seed=3)[0]
        names = list(te_model.state_dict())
        assert any(n.endswith("linear_qkv.layer_norm_weight") for n in names), "not built with the TE spec"
        real_spec = gpt.layer_spec
        gpt.layer_spec = get_gpt_layer_local_spec
        try:
            local_model = gpt.build_gpt(cfg, pctx, seed=3)[0]
        finally:
            gpt.layer_spec = real_spec
        a, b = full_state_dict([te_model], pctx), full_state_dict([local_model], pctx)
        assert list(a) == list(b), (list(a)[:6], list(b)[:6])
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
        with torch.no_grad():
            la, lb = te_model(**model_inputs(tokens)), local_model(**model_inputs(tokens))
        err = (la - lb).abs().max().item()
        assert err < 1e-3 * max(1.0, lb.abs().max().item()), err
        print(f"TE_SPEC_OK {cfg.normalization} {cfg.activation} max_logit_diff={err:.2e}", flush=True)
    pctx.destroy()
    shutdown_distributed(env)


if __name__ == "__main__":
    main()
