"""LoRA (model.lora) on real megatron-core layers, with transformers and peft as the reference.

One SFT run with LoRA on a tiny transformers-made Llama (GQA, SwiGLU) at TP=2 on real mpirun
ranks (tests/programs/lora_worker.py), then a DPO run on the same model, are shared by the tests:
adapters at init leave the logits exactly the base's; after training only adapters changed; the
reference (adapters off) gives the base's log-probs, and DPO's margin starts at 0 and moves; the
merged shards (the refit's weights) give the LoRA model's logits; TP shapes. `export hf` of the
adapter-only checkpoint: merged weights that transformers loads, and with --adapter a PEFT
folder that peft loads onto the base, both with slurm-align's logits. Bad input: unknown or
absent targets, LoRA where nothing would train it, an adapter export of a run without LoRA.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import validate
from slurm_align.config.run import RunConfig

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.integration.test_hf_models import ROOT, SHAPE, _perturb, cli, mpirun, save_tokenizer  # noqa: E402

TOL = 1e-4
RANK, ALPHA, TP = 4, 8.0, 2
WORKER = Path(__file__).parents[1] / "programs" / "lora_worker.py"


def _tokens() -> torch.Tensor:
    return torch.randint(3, 259, (3, 17), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """RUN_DIR of the shared LoRA SFT run (3 steps, TP=2) with the worker's results."""
    root = tmp_path_factory.mktemp("lora")
    hf_dir = root / "llama"
    torch.manual_seed(0)
    _perturb(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)), 1).save_pretrained(hf_dir)
    save_tokenizer(hf_dir)
    run_dir = root / "run"
    run_dir.mkdir()
    run = validate(RunConfig, {
        "algorithm": "sft", "seed": 3,
        "model": {"hf_path": str(hf_dir), "lora": {"rank": RANK, "alpha": ALPHA}},
        "actor": {"tensor_parallel": TP, "pipeline_parallel": 1, "data_parallel": 1},
        "data": {"train_path": str(ROOT / "examples/synthetic/sft_train.jsonl")},
        "trainer": {"num_steps": 3, "global_batch_size": 4, "micro_batch_size": 4, "lr": 5e-2,
                    "save_interval": 0, "eval_interval": 0}}, "test")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(run.model_dump(mode="json"), sort_keys=False))
    dpo = run.model_copy(update={"algorithm": "dpo", "data": run.data.model_copy(
        update={"train_path": ROOT / "examples/synthetic/pref_train.jsonl"})})
    (run_dir / "dpo.yaml").write_text(yaml.safe_dump(dpo.model_dump(mode="json"), sort_keys=False))
    torch.save(_tokens(), run_dir / "tokens.pt")
    mpirun(TP, str(TP), str(run_dir), worker=WORKER)
    return run_dir


def _results(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / f"result{r}.json").read_text()) for r in range(TP)]


@pytest.mark.mpi
def test_lora_training_changes_only_adapters(lora_run: Path):
    """B = 0 at init: logits exactly the base's; the optimizer holds the adapters only; after 3
    steps every B changed, every base tensor is bit-identical, the reference (adapters off)
    gives the base's log-probs exactly, and the merged shards give the LoRA model's logits."""
    for res in _results(lora_run):
        assert res["init_logits_equal"]
        assert res["optimizer_params"] == res["adapter_params"] > 0
        assert res["base_identical"]
        changed = res["adapters_changed"]
        assert len(changed) == 2 * 9 and all(changed.values()), changed   # per layer: 4 A, 4 B + B_up
        assert res["lora_differs_from_base"] > 1e-3   # training moved the policy
        assert res["reference_logprobs_equal_base"]
        assert res["merged_err"] <= TOL
        assert res["base_back_after_merge"]


@pytest.mark.mpi
def test_dpo_with_lora_reference_is_the_adapters_off_model(lora_run: Path):
    """DPO's margin compares the policy with the reference: 0 exactly at step 1 (B = 0, the
    adapters-off reference is the same function), nonzero once the adapters trained (the
    reference stayed the base and the policy kept its adapters)."""
    rows = [json.loads(line) for line in (lora_run / "dpo" / "metrics.jsonl").read_text().splitlines()]
    margins = {r["step"]: r["reward_margin"] for r in rows}
    assert margins[1] == 0.0 and abs(margins[3]) > 1e-4, margins


@pytest.mark.mpi
def test_lora_tp_shapes(lora_run: Path):
    """Column-parallel (qkv, fc1): A [r, in] replicated, B split on its output rows; row-parallel
    (proj, fc2): A split on its input columns, B [out, r] replicated."""
    h, heads, groups, ffn = SHAPE["hidden_size"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], \
        SHAPE["intermediate_size"]
    head_dim = h // heads
    qkv_out = (heads + 2 * groups) * head_dim
    want = {"self_attention.linear_qkv.lora_A": ([RANK, h], None),
            "self_attention.linear_qkv.lora_B": ([qkv_out // TP, RANK], 0),
            "self_attention.linear_proj.lora_A": ([RANK, heads * head_dim // TP], 1),
            "self_attention.linear_proj.lora_B": ([h, RANK], None),
            "mlp.linear_fc1.lora_A": ([RANK, h], None),
            "mlp.linear_fc1.lora_B_gate": ([ffn // TP, RANK], 0),
            "mlp.linear_fc1.lora_B_up": ([ffn // TP, RANK], 0),
            "mlp.linear_fc2.lora_A": ([RANK, ffn // TP], 1),
            "mlp.linear_fc2.lora_B": ([h, RANK], None)}
    for res in _results(lora_run):
        for layer in range(SHAPE["num_hidden_layers"]):
            for suffix, (shape, split) in want.items():
                key = f"decoder.layers.{layer}.{suffix}"
                assert res["shapes"][key] == shape, key
                assert res["tp_split"][key] == split, key


@pytest.mark.mpi
def test_lora_checkpoint_holds_adapters_and_base_reference(lora_run: Path):
    from megatron.core import dist_checkpointing
    ckpt = lora_run / "checkpoints" / "sft" / "iter_0000003"
    keys = list(dist_checkpointing.load_tensors_metadata(str(ckpt)))
    assert keys and all(".lora_" in k for k in keys), keys
    common = dist_checkpointing.load_common_state_dict(str(ckpt))["common"]
    assert common["lora"] and common["lora_base"]["hf_path"] == str(lora_run.parent / "llama")


@pytest.mark.mpi
def test_lora_export_merged_and_peft_adapter(lora_run: Path, tmp_path: Path):
    """`export hf` (the CLI): merged weights transformers
    loads with slurm-align's logits; `--adapter`: a PEFT folder that peft loads onto the base,
    with the same logits."""
    ours = torch.load(lora_run / "lora_logits.pt")
    ckpts, merged_dir, adapter_dir = lora_run / "checkpoints" / "sft", tmp_path / "merged", tmp_path / "adapter"
    for extra in ([], ["--adapter"]):
        proc = cli("export", "hf", str(ckpts), str(adapter_dir if extra else merged_dir), *extra)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert sorted(p.name for p in adapter_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir)(_tokens()).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(lora_run.parent / "llama")
        peft_logits = peft.PeftModel.from_pretrained(base, adapter_dir)(_tokens()).logits
    assert (merged - ours).abs().max().item() <= TOL
    assert (peft_logits - ours).abs().max().item() <= TOL


@pytest.mark.mpi
def test_adapter_export_without_lora_is_refused(lora_run: Path, tmp_path: Path):
    """A checkpoint of a run without LoRA (the worker's save of the base) has no adapters to
    export: a ConfigError naming it, before anything is written."""
    from slurm_align.models.hf.exporter import export_hf
    with pytest.raises(ConfigError) as e:
        export_hf(lora_run / "full", tmp_path / "out", adapter=True)
    assert "--adapter" in str(e.value) and "no LoRA adapters" in str(e.value) and "full" in str(e.value)
    assert list(tmp_path.iterdir()) == []   # neither the target nor a temp folder


def _run(model: dict) -> dict:
    return {"algorithm": "sft", "model": model, "data": {"train_path": "x.jsonl"}}


@pytest.mark.parametrize("lora,field,needle", [
    ({"targets": ["qkv", "mlp"]}, "model.lora.targets.1", "'qkv', 'proj', 'fc1' or 'fc2'"),
    ({"targets": []}, "model.lora.targets", "at least one of qkv, proj, fc1, fc2"),
    ({"rank": 0}, "model.lora.rank", "greater than or equal to 1"),
])
def test_bad_lora_config(lora: dict, field: str, needle: str):
    with pytest.raises(ConfigError) as e:
        validate(RunConfig, _run({"lora": lora}), "run.yaml")
    text = str(e.value)
    assert "run.yaml" in text and f"field '{field}'" in text and needle in text, text


def test_lora_mlp_targets_absent_from_moe_model():
    """An MoE model's MLP is its routed experts: fc1/fc2 adapters do not exist there."""
    with pytest.raises(ConfigError) as e:
        validate(RunConfig, _run({"num_experts": 4, "activation": "swiglu", "lora": {"targets": ["qkv", "fc1"]}}),
                 "run.yaml")
    text = str(e.value)
    assert "run.yaml" in text and "lora.targets=['qkv', 'fc1']" in text and "allowed: qkv, proj" in text, text


@pytest.mark.parametrize("run,needle", [
    ({"algorithm": "rm", "model": {"lora": {}}}, "model.lora: reward-model training"),
    ({"algorithm": "sft", "critic_model": {"lora": {}}}, "critic_model.lora: the critic trains its full weights"),
])
def test_lora_refused_where_nothing_would_train_it(run: dict, needle: str):
    with pytest.raises(ConfigError) as e:
        validate(RunConfig, {"data": {"train_path": "x.jsonl"}, **run}, "run.yaml")
    assert "run.yaml" in str(e.value) and needle in str(e.value), str(e.value)


MOE = ["model.num_experts=4", "model.moe_aux_loss_coeff=0.01", "model.add_bias_linear=false", "model.activation=swiglu",
       "model.normalization=RMSNorm", "model.position_embedding=rope"]
MOE_SFT_STEPS = 50
"""A short SFT of the MoE model on the sort task (about as long as the session's dense SFT policy
is trained): its responses end and some are right, so GRPO's gradient is not 0 (from a random
init no response ends within the budget: the loss has no token and the adapters never move)."""


@pytest.mark.slow
def test_grpo_actor_with_lora_on_a_moe_model(tmp_path: Path):
    """The RL actor (2 ranks, DP=2) with LoRA on qkv/proj of a mixture-of-experts model, from a
    short SFT of that model: the engine generates from the merged refit (once the first update
    moved the adapters, the engine's log-probs of the tokens it sampled are the trainer's with
    the adapters on), the reference is the adapters-off model, the actor's checkpoint holds
    adapters only, and the update's router statistics are in the metrics."""
    from megatron.core import dist_checkpointing

    from slurm_align import REPO_ROOT
    from slurm_align.config import load_run_config
    from slurm_align.store.rollouts import RolloutStore
    from tests.integration.test_grpo import grpo_config, launch, metrics
    synth = REPO_ROOT / "examples" / "synthetic"
    sft = load_run_config(REPO_ROOT / "examples" / "sft_tiny.yaml", [
        f"data.train_path={synth / 'sft_train.jsonl'}", f"data.val_path={synth / 'sft_val.jsonl'}",
        "trainer.save_interval=0", f"trainer.num_steps={MOE_SFT_STEPS}", *MOE])
    launch(tmp_path, sft, name="sft")
    # the partial reward differs inside nearly every group; a higher rate than GRPO's for adapters
    base = tmp_path / "sft" / "checkpoints" / "sft"
    run = grpo_config(*MOE, "model.lora.targets=[qkv,proj]", f"model.init_checkpoint={base}",
                      "reward.rule=slurm_align.rewards.sort:partial", "ppo.actor_lr=2e-3", "eval.interval=0")
    launch(tmp_path, run)
    rows = metrics(tmp_path / "run")
    assert [m["step"] for m in rows] == [1, 2] and all(m["train_optim/grad_norm"] > 0 for m in rows), rows
    last = rows[-1]
    loads = [last[f"train_optim/moe/expert_load_{e}"] for e in range(4)]
    assert abs(sum(loads) - 1.0) < 1e-6 and last["train_optim/moe/load_max_over_mean"] >= 1.0
    assert last["train_optim/moe/aux_loss"] > 0
    # step 2 was generated after the refit of step 1's update: the engine's log-probs (rollout_logprobs)
    # are the trainer's pi_old, its forward with the adapters on (measured 2e-6 apart; a refit of the
    # base weights alone: 1.3)
    d = RolloutStore.open(tmp_path / "run" / "rollouts.zarr", read_only=True).read(2)
    assert len(d["logprobs"]) > 0 and float(abs(d["rollout_logprobs"] - d["logprobs"]).max()) < 1e-4
    ckpt = tmp_path / "run" / "checkpoints" / "actor" / "iter_0000002"
    keys = list(dist_checkpointing.load_tensors_metadata(str(ckpt)))
    assert keys and all(".lora_" in k for k in keys) and not any(".mlp." in k for k in keys), keys
    ref = dist_checkpointing.load_common_state_dict(str(ckpt))["common"]["lora_base"]
    assert ref["init_checkpoint"].startswith(str(base)), ref
