"""config/memory_plan.py against the real thing: parameter counts equal the tensors of built
megatron models (several architectures, LoRA), the optimizer's bytes equal those a real
ModelOptimizer holds, activations come within 15% of the peak autograd holds for backward, and `submit`
refuses a layout that cannot fit before anything is written. (ZeRO-1 at DP 2:
tests/integration/test_optimizer.py compares the plan with both ranks' bytes.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slurm_align import REPO_ROOT
from slurm_align.cli import main as cli_main
from slurm_align.config.memory_plan import activation_elements, count_params, plan_model, plan_run
from slurm_align.config.run import LoraConfig, ModelConfig, ParallelConfig, RunConfig, TrainingConfig
from slurm_align.models.gpt import build_gpt
from slurm_align.models.lora import attach_configured, trainable_parameters
from slurm_align.models.optimizer import build_optimizer
from tests.support.single_rank import single_rank_world
from tests.unit.models.test_optimizer import LONG, saved_activation_bytes

ONE = ParallelConfig()
LLAMA = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                    vocab_size=300, max_seq_len=32, position_embedding="rope", normalization="RMSNorm",
                    activation="swiglu", add_bias_linear=False, tie_embeddings=True)
SHAPES = {
    "gpt": (ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100), False),
    "llama_tied": (LLAMA, False),
    "qwen_qkv_bias_qk_norm": (LLAMA.model_copy(update={"add_qkv_bias": True, "qk_layernorm": True,
                                                       "tie_embeddings": False}), False),
    "value_head": (LLAMA, True),
    # MoE (megatron's router + SequentialMLP experts): Qwen3-MoE-like and GELU experts with biases
    "moe_swiglu": (LLAMA.model_copy(update={"num_experts": 4, "moe_router_topk": 2, "tie_embeddings": False}), False),
    "moe_gelu_bias": (ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, num_experts=3,
                                  moe_router_topk=2, ffn_hidden_size=40), False),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_parameter_count_equals_the_built_model(name: str):
    cfg, value_head = SHAPES[name]
    with single_rank_world() as (_, pctx):
        chunks = build_gpt(cfg, pctx, value_head=value_head, seed=1, init=False)
        built = sum(p.numel() for c in chunks for p in c.parameters())
    assert count_params(cfg, ONE, value_head=value_head) == (built, built)


def test_lora_trained_count_and_optimizer_bytes_equal_the_real_optimizer():
    cfg = LLAMA.model_copy(update={"lora": LoraConfig(rank=4, targets=["qkv", "proj", "fc1", "fc2"])})
    with single_rank_world() as (_, pctx):
        chunks = build_gpt(cfg, pctx, seed=1)
        attach_configured(chunks, cfg, pctx, 1)
        trained = trainable_parameters(chunks)
        opt = build_optimizer(trained, pctx, TrainingConfig(), lr=1e-3)
        for p in trained:
            p.grad = torch.ones_like(p)
        opt.step()   # Adam makes its state at the first step
        moments = sum(t.numel() * t.element_size() for st in opt.optimizer.state.values()
                      for k, t in st.items() if k in ("exp_avg", "exp_avg_sq"))
    plan = plan_model("policy", cfg, ONE, TrainingConfig())
    assert plan.trained == sum(p.numel() for p in trained)
    assert plan.optimizer == moments and plan.main_weights == 0
    assert plan.grads == 4 * plan.trained and plan.weights == 4 * plan.params


@pytest.mark.parametrize("shape", ["llama_tied", "moe_swiglu"])
def test_bf16_plan_equals_the_real_optimizers_tensors(shape: str):
    t = TrainingConfig(precision="bf16")
    cfg = SHAPES[shape][0]
    with single_rank_world() as (_, pctx):
        chunks = build_gpt(cfg, pctx, seed=1, training=t)
        params = [p for c in chunks for p in c.parameters()]
        opt = build_optimizer(params, pctx, t, lr=1e-3)
        opt.step()
        moments = sum(x.numel() * x.element_size() for st in opt.optimizer.state.values()
                      for k, x in st.items() if k in ("exp_avg", "exp_avg_sq"))
        weights = sum(p.numel() * p.element_size() for p in params)
        grads = sum(p.main_grad.numel() * p.main_grad.element_size() for p in params)
        main = sum(b.main.numel() * b.main.element_size() for b in opt.buckets)
    plan = plan_model("policy", cfg, ONE, t)
    assert (plan.weights, plan.grads, plan.main_weights, plan.optimizer) == (weights, grads, main, moments)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activations_within_15_percent_of_the_peak_autograd_holds(recompute: str):
    tokens = torch.randint(0, LONG.vocab_size, (4, 64), generator=torch.Generator().manual_seed(3))
    with single_rank_world() as (_, pctx):
        chunks = build_gpt(LONG, pctx, seed=11, training=TrainingConfig(recompute=recompute))
        measured, _ = saved_activation_bytes(chunks, tokens)
    planned = 4 * activation_elements(LONG, 1, 1, tokens=4 * 64, rows=4, recompute=recompute)
    assert abs(planned - measured) / measured < 0.15, (planned, measured)   # measured: within 3%


def test_plan_shows_the_components_and_what_offload_saves():
    run = RunConfig.model_validate({"algorithm": "ppo", "model": LLAMA.model_dump(), "data": {"train_path": "p"},
                                    "switches": {"offload_optimizer": False}})
    held = plan_run(run)
    offloaded = plan_run(run.model_copy(update={"switches": run.switches.model_copy(
        update={"offload_optimizer": True})}))
    assert [c.name for c in held] == ["actor", "critic"]
    policy = held[0].models[0]
    assert held[0].generation_peak - offloaded[0].generation_peak == policy.grads + policy.optimizer


def test_submit_refuses_a_layout_that_cannot_fit_before_writing_anything(tmp_path: Path, capsys):
    run_dir = tmp_path / "run"
    code = cli_main(["submit", str(REPO_ROOT / "examples" / "sft_tiny.yaml"), "--profile", "local",
                     "-P", "gpu_memory_gib=0.001", "--run-dir", str(run_dir)])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code == 2 and not run_dir.exists()
    assert "sft_tiny.yaml" in text and "gpu_memory_gib=0.001" in text and "GiB per GPU" in text
    assert "--skip-memory-check" in text


def test_plan_command_prints_each_component_against_the_profile(capsys):
    code = cli_main(["plan", str(REPO_ROOT / "examples" / "plans" / "llama3_8b_ppo.yaml"),
                     "--profile", "example-gpu-cluster"])
    text = capsys.readouterr().out
    assert code == 0
    assert "actor      policy      2,007,764,992" in text   # Llama-3-8B / TP 4 (8.03e9 / 4)
    assert "critic     TOTAL" in text and "of 80 GiB fits" in text and "KV cache" in text


def test_the_gpu_profile_trains_in_bf16_unless_the_run_says_otherwise(tmp_path: Path, capsys):
    """The shipped GPU profile's `precision: bf16` is the default of runs that leave
    training.precision unset (the plan shows bf16 weights); a config's own value wins; the CPU
    profiles leave fp32."""
    from slurm_align.config import load_profile, load_run_config
    from slurm_align.config.loading import with_profile_defaults

    text = (REPO_ROOT / "examples" / "plans" / "llama3_8b_ppo.yaml").read_text()
    config = tmp_path / "run.yaml"
    config.write_text(text.replace("training: {precision: bf16, ", "training: {"))
    gpu, local = load_profile("example-gpu-cluster"), load_profile("local")
    unset = load_run_config(config)
    assert unset.training.precision == "fp32"
    assert with_profile_defaults(unset, gpu).training.precision == "bf16"
    assert with_profile_defaults(unset, gpu).training.distributed_optimizer   # the rest is the run's
    assert with_profile_defaults(unset, local).training.precision == "fp32"
    for own in ("fp32", "fp16"):
        assert with_profile_defaults(load_run_config(config, [f"training.precision={own}"]),
                                     gpu).training.precision == own
    assert cli_main(["plan", str(config), "--profile", "example-gpu-cluster"]) == 0
    policy = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("actor      policy"))
    assert policy.split()[3] == f"{2_007_764_992 * 2 / 2 ** 30:.2f}"   # TP 4's share of 8.03e9, 2 bytes each
