"""Qwen3 (per-head q/k RMSNorm, head_dim independent of the width) and the MoE models
Qwen3-MoE and Mixtral (megatron-core's MoE layers, expert parallelism) against transformers.

One tiny random Qwen3 (and its ForSequenceClassification twin) and one tiny Qwen3-MoE and Mixtral
are made by transformers here and saved with save_pretrained, shared by the module. Imported through
model.hf_path on real mpirun ranks (tests/programs/hf_worker.py) it must give transformers' logits
at TP=1, TP=2 and PP=2; the torch engines generate greedily as transformers' generate; import -> SFT
steps -> export loads in transformers with the trained logits; its chat template renders as
transformers' apply_chat_template.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slurm_align.config.run import ModelConfig
from tests.integration.test_generation_hf import assert_generates_as_transformers
from tests.integration.test_hf_models import (
    ROOT,
    TOL,
    _perturb,
    cli,
    import_train_export,
    mpirun,
    mpirun_plan,
    reference,
    save_tokenizer,
    tokens,
)

transformers = pytest.importorskip("transformers")

# head_dim 16 with hidden 32 and 4 heads (hidden / heads = 8): q is 64 wide, o_proj 64 -> 32.
QWEN3 = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=260, max_position_embeddings=64)


def make_qwen3(root: Path) -> dict[str, Path]:
    t = transformers
    models = {
        "qwen3": t.Qwen3ForCausalLM(t.Qwen3Config(**QWEN3, tie_word_embeddings=True)),
        "qwen3_rm": t.Qwen3ForSequenceClassification(t.Qwen3Config(**QWEN3, num_labels=1, pad_token_id=259)),
    }
    out = {}
    for i, (name, model) in enumerate(models.items()):
        out[name] = root / "models" / name
        _perturb(model, 10 + i).save_pretrained(out[name])   # q/k norms away from 1 as well
    save_tokenizer(out["qwen3"])
    return out


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen3")
    make_qwen3(root)
    torch.save(tokens(), root / "tokens.pt")
    return root


def test_qwen3_fields_from_config(zoo: Path):
    cfg = ModelConfig(hf_path=zoo / "models" / "qwen3")
    assert cfg.qk_layernorm and cfg.kv_channels == 16 and cfg.hidden_size == 32
    assert not cfg.add_qkv_bias and not cfg.add_bias_linear and cfg.tie_embeddings
    with pytest.raises(ValueError, match=r"qk_layernorm.*conflicts"):
        ModelConfig(hf_path=zoo / "models" / "qwen3", qk_layernorm=False)


@pytest.mark.mpi
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_qwen3_logits_equal_transformers(launched: None, zoo: Path, tp: int, pp: int):
    toks = torch.load(zoo / "tokens.pt")
    for folder in sorted((zoo / "models").iterdir()):
        ours = torch.load(zoo / "out" / f"{folder.name}_tp{tp}_pp{pp}.pt")
        if folder.name.endswith("_rm"):
            ours = ours[:, -1]
        ref = reference(folder, toks)
        assert ours.shape == ref.shape, folder.name
        err = (ours - ref).abs().max().item()
        assert err <= TOL, f"{folder.name} TP={tp} PP={pp}: max |ours - transformers| = {err}"


def test_qwen3_generates_as_transformers(tmp_path: Path):
    """Both torch engines, refitted from the imported model, reproduce transformers' greedy
    generate token for token (large init: peaked logits, far from ties)."""
    t = transformers
    shape = dict(QWEN3, hidden_size=64, intermediate_size=96, vocab_size=250, max_position_embeddings=128,
                 bos_token_id=None, eos_token_id=None, initializer_range=0.3)
    folder = tmp_path / "qwen3_gen"
    _perturb(t.Qwen3ForCausalLM(t.Qwen3Config(**shape)), 21).save_pretrained(folder)
    assert_generates_as_transformers([folder], tmp_path)


@pytest.mark.slow
@pytest.mark.mpi
def test_qwen3_round_trip_import_train_export(zoo: Path, tmp_path: Path):
    """import -> 4 SFT steps at TP=2 -> export: transformers loads the export as a Qwen3 and
    gives the trained model's logits (the q/k norms trained and written back as q_norm/k_norm)."""
    qwen3 = zoo / "models" / "qwen3"
    trained = import_train_export(qwen3, tmp_path, steps=4, export=tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 16

    work = tmp_path / "work"
    work.mkdir()
    (work / "hf_dir.txt").write_text(str(qwen3))
    (work / "ckpt.txt").write_text(str(trained))
    torch.save(tokens(), work / "tokens.pt")
    mpirun(1, "resave", "1", "1", str(work))
    ours = torch.load(work / "trained_logits.pt")
    with torch.no_grad():
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")(tokens()).logits
    assert (exported - ours).abs().max().item() <= TOL
    assert (reference(qwen3, tokens()) - ours).abs().max().item() > 1e-3, "the SFT steps changed nothing"
    from safetensors import safe_open
    with safe_open(tmp_path / "export" / "model.safetensors", "pt") as f:
        q_norm = f.get_tensor("model.layers.0.self_attn.q_norm.weight")
    base = transformers.AutoModelForCausalLM.from_pretrained(qwen3).model.layers[0].self_attn.q_norm.weight
    assert q_norm.shape == (16,) and not torch.equal(q_norm, base.detach()), "q_norm was not trained/exported"


# Qwen3 style: ChatML with <think> blocks, reasoning_content, the last user turn found by a
# reversed loop over a namespace, string methods (split, strip, startswith), enable_thinking.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- set content = message.content if message.content is string else '' %}\n"
    "    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- elif '</think>' in content %}\n"
    "            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}\n"
    "            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}\n"
    "            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>assistant\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)


@pytest.mark.parametrize("gen_prompt", [False, True])
def test_qwen3_chat_template_renders_as_transformers(tmp_path: Path, gen_prompt: bool):
    from slurm_align.models.tokenizer import HFTokenizer
    from tests.unit.models.test_chat_template import make_tokenizer
    folder = make_tokenizer(tmp_path / "qwen3_tok", QWEN3_TEMPLATE,
                            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                            ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    ours = HFTokenizer(folder)
    convs = [
        [{"role": "user", "content": "Sort these digits: 7 3 9 1"}],
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "What is two plus two?"},
         {"role": "assistant", "content": "<think>\n2 + 2 = 4\n</think>\n\nTwo plus two is four."}],
        [{"role": "user", "content": "What is two plus two?"},
         {"role": "assistant", "content": "Four.", "reasoning_content": "add them"},
         {"role": "user", "content": "Thanks! é ü"}],
    ]
    for conv in convs:
        want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen_prompt)
        got = ours.apply_chat_template(conv, add_generation_prompt=gen_prompt)
        assert got == want
    # the think block of the answer after the last user turn is kept (reasoning split off)
    assert "<think>\n2 + 2 = 4\n</think>\n\nTwo plus two is four." in ours.apply_chat_template(convs[1])


# --- mixture of experts: Qwen3-MoE (softmax over all experts, top-k not renormalised) and
# Mixtral (softmax over the top-k logits) -----------------------------------------------------
MOE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=260,
           max_position_embeddings=64, num_experts_per_tok=2)


def make_moe(root: Path, **shape) -> dict[str, Path]:
    t = transformers
    s = {**MOE, **shape}
    models = {
        "mixtral": t.MixtralForCausalLM(t.MixtralConfig(**s, intermediate_size=40, num_local_experts=4)),
        "qwen3_moe": t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(**s, head_dim=16, intermediate_size=48,
                                                            moe_intermediate_size=24, num_experts=4,
                                                            norm_topk_prob=False)),
    }
    out = {}
    for i, (name, model) in enumerate(models.items()):
        out[name] = root / "models" / name
        _perturb(model, 30 + i).save_pretrained(out[name])
        save_tokenizer(out[name])
    return out


@pytest.fixture(scope="module")
def moe_zoo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe")
    make_moe(root)
    torch.save(tokens(), root / "tokens.pt")
    return root


@pytest.fixture(scope="module")
def launched(zoo: Path, moe_zoo: Path) -> None:
    """This file's rank programs that need nothing but the zoos, all layouts in two launches (one
    rank, two ranks): Qwen3's logits at TP=1, TP=2, PP=2 (zoo/out), the MoE logits at EP=1,
    EP=2, PP=2 (moe_zoo/out), the MoE gradients at EP=1 and DP=2 x EP=2 (moe_zoo/grads)."""
    grads = moe_zoo / "grads"
    grads.mkdir()
    (grads / "hf_dir.txt").write_text(str(moe_zoo / "models" / "qwen3_moe"))
    torch.save(tokens()[:2], grads / "tokens.pt")
    mpirun_plan(1, [("hf", "logits", 1, 1, 1, zoo), ("moe", "logits", 1, 1, 1, moe_zoo),
                    ("moe", "grads", 1, 1, 1, grads)], moe_zoo / "plan1.json")
    mpirun_plan(2, [("hf", "logits", 2, 1, 1, zoo), ("hf", "logits", 1, 2, 1, zoo),
                    ("moe", "logits", 1, 1, 2, moe_zoo), ("moe", "logits", 1, 2, 1, moe_zoo),
                    ("moe", "grads", 1, 1, 2, grads)], moe_zoo / "plan2.json")


def test_moe_fields_from_config(moe_zoo: Path):
    mixtral = ModelConfig(hf_path=moe_zoo / "models" / "mixtral")
    assert (mixtral.num_experts, mixtral.moe_router_topk, mixtral.moe_norm_topk_prob) == (4, 2, True)
    assert mixtral.ffn == 40 and not mixtral.qk_layernorm and mixtral.moe_aux_loss_coeff == 0.001
    qwen = ModelConfig(hf_path=moe_zoo / "models" / "qwen3_moe")
    assert (qwen.num_experts, qwen.ffn, qwen.moe_norm_topk_prob, qwen.qk_layernorm) == (4, 24, False, True)
    assert ModelConfig(hf_path=moe_zoo / "models" / "qwen3_moe", moe_aux_loss_coeff=0.0).moe_aux_loss_coeff == 0.0


@pytest.mark.mpi
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (1, 1, 2), (1, 2, 1)])
def test_moe_logits_equal_transformers(launched: None, moe_zoo: Path, tp: int, pp: int, ep: int):
    """Each EP rank reads and holds only its experts; tokens reach them by all-to-all (gloo)."""
    toks = torch.load(moe_zoo / "tokens.pt")
    for folder in sorted((moe_zoo / "models").iterdir()):
        ours = torch.load(moe_zoo / "out" / f"{folder.name}_tp{tp}_pp{pp}_ep{ep}.pt")
        ref = reference(folder, toks)
        assert ours.shape == ref.shape, folder.name
        err = (ours - ref).abs().max().item()
        assert err <= TOL, f"{folder.name} TP={tp} PP={pp} EP={ep}: max |ours - transformers| = {err}"
        if ep == 2:  # rank r read experts 2r and 2r+1 only (of every layer), and all the rest alike
            read = [torch.load(moe_zoo / "out" / f"{folder.name}_ep2_read{r}.pt") for r in range(2)]
            experts = [{int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n}
                       for names in read]
            assert experts == [{0, 1}, {2, 3}], experts
            assert [n for n in read[0] if ".experts." not in n] == [n for n in read[1] if ".experts." not in n]


def test_moe_generates_as_transformers(tmp_path: Path):
    """The torch engines run the MoE layers (router top-k, each expert on its tokens): greedy
    generation equals transformers' generate for both routings (large init: far from ties)."""
    folders = make_moe(tmp_path, hidden_size=64, vocab_size=250, max_position_embeddings=128,
                       bos_token_id=None, eos_token_id=None, initializer_range=0.3)
    assert_generates_as_transformers(list(folders.values()), tmp_path)


@pytest.fixture(scope="module")
def moe_sft(moe_zoo: Path, tmp_path_factory) -> Path:
    """One SFT of the imported Qwen3-MoE at DP=2 x EP=2 (expert gradients reduced over their own
    replicas) with the aux loss on, 3 steps, for the tests below: DIR/run (its metrics and EP=2
    checkpoint), DIR/export_ep2 (that checkpoint's export), DIR/work/trained_logits.pt (the
    checkpoint loaded at EP=1: its logits), DIR/export_ep1 (the export of the same weights saved
    again at EP=1, tests/programs/hf_worker.py resave)."""
    tmp = tmp_path_factory.mktemp("moe_sft")
    folder = moe_zoo / "models" / "qwen3_moe"
    cfg = {"algorithm": "sft", "seed": 1, "model": {"hf_path": str(folder), "moe_aux_loss_coeff": 0.01},
           "actor": {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 2, "expert_parallel": 2},
           "data": {"train_path": str(ROOT / "examples/synthetic/sft_train.jsonl")},
           "trainer": {"num_steps": 3, "global_batch_size": 4, "micro_batch_size": 2, "lr": 1e-2,
                       "save_interval": 0, "eval_interval": 0}}
    (tmp / "sft.yaml").write_text(json.dumps(cfg))
    run_dir = tmp / "run"
    proc = cli("train", "sft", str(tmp / "sft.yaml"), "--profile", "local", "--run-dir", str(run_dir), "--follow")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    proc = cli("export", "hf", str(run_dir / "checkpoints" / "sft"), str(tmp / "export_ep2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    work = tmp / "work"
    work.mkdir()
    (work / "hf_dir.txt").write_text(str(folder))
    (work / "ckpt.txt").write_text(str(run_dir / "checkpoints" / "sft" / "iter_0000003"))
    torch.save(tokens(), work / "tokens.pt")
    mpirun(1, "resave", "1", "1", str(work))   # one rank: EP=1
    proc = cli("export", "hf", str(work / "resaved" / "checkpoints" / "sft"), str(tmp / "export_ep1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp


@pytest.mark.slow
@pytest.mark.mpi
def test_moe_ep2_checkpoint_exports_as_ep1(moe_sft: Path):
    """The same Qwen3-MoE weights saved at EP=2 (the SFT's two ranks, two experts each) and at
    EP=1 export the very same files; transformers loads the export with the logits of the EP=2
    checkpoint loaded at EP=1."""
    names = sorted(p.name for p in (moe_sft / "export_ep2").iterdir())
    assert {"config.json", "model.safetensors"} <= set(names)
    assert names == sorted(p.name for p in (moe_sft / "export_ep1").iterdir())
    for name in names:
        a, b = (moe_sft / "export_ep2" / name).read_bytes(), (moe_sft / "export_ep1" / name).read_bytes()
        assert a == b, f"{name} differs between the EP=2 and the EP=1 checkpoint's export"
    config = json.loads((moe_sft / "export_ep2" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["norm_topk_prob"] is False
    with torch.no_grad():
        exported = transformers.AutoModelForCausalLM.from_pretrained(moe_sft / "export_ep1")(tokens()).logits
    assert (exported - torch.load(moe_sft / "work" / "trained_logits.pt")).abs().max().item() <= TOL


@pytest.mark.parametrize("actor,needles", [
    ({"data_parallel": 3, "expert_parallel": 3}, ["actor.expert_parallel=3", "model.num_experts=4"]),
    ({"data_parallel": 1, "expert_parallel": 2}, ["actor.expert_parallel=2", "actor.data_parallel=1"]),
    ({"tensor_parallel": 2, "data_parallel": 1}, ["actor.tensor_parallel=2", "tensor_parallel=1"]),
], ids=["experts-not-divisible", "ep-not-dividing-dp", "tp-with-moe"])
def test_bad_expert_layout_is_a_clear_error_and_submits_nothing(moe_zoo: Path, tmp_path: Path, actor, needles):
    from slurm_align.config.errors import ConfigError
    from tests.unit.config.test_loading import _try_submit
    cfg = {"algorithm": "sft", "model": {"hf_path": str(moe_zoo / "models" / "mixtral")}, "actor": actor,
           "data": {"train_path": str(ROOT / "examples/synthetic/sft_train.jsonl")}}
    path = tmp_path / "sft.yaml"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as info:
        _try_submit(path, "local", tmp_path)
    for needle in [*needles, str(path)]:
        assert needle in str(info.value), str(info.value)
    assert not (tmp_path / "run").exists(), "nothing may be written or submitted on bad input"


def test_expert_parallel_on_a_dense_model_is_refused(zoo: Path, tmp_path: Path):
    from slurm_align.config.errors import ConfigError
    from tests.unit.config.test_loading import _try_submit
    cfg = {"algorithm": "sft", "model": {"hf_path": str(zoo / "models" / "qwen3")},
           "actor": {"data_parallel": 2, "expert_parallel": 2},
           "data": {"train_path": str(ROOT / "examples/synthetic/sft_train.jsonl")}}
    path = tmp_path / "sft.yaml"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="expert_parallel=2 needs a mixture-of-experts model"):
        _try_submit(path, "local", tmp_path)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.mpi
def test_moe_sft_with_expert_parallel_exports_and_logs_router_stats(moe_zoo: Path, moe_sft: Path):
    """SFT of the imported Qwen3-MoE at DP=2 x EP=2 with the aux loss on (the `moe_sft` run):
    router statistics in the metrics; the EP=2 training checkpoint, loaded at EP=1, gives the
    logits transformers gives for its export, and they are not the untrained ones."""
    rows = [json.loads(line) for line in (moe_sft / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "moe/load_max_over_mean" in json.dumps(r)]
    assert len(steps) == 3, rows[-3:]
    flat = json.dumps(steps[-1])
    assert all(f'"moe/expert_load_{e}"' in flat for e in range(4)) and '"moe/aux_loss"' in flat, flat
    ours = torch.load(moe_sft / "work" / "trained_logits.pt")
    with torch.no_grad():
        exported = transformers.AutoModelForCausalLM.from_pretrained(moe_sft / "export_ep2")(tokens()).logits
    assert (exported - ours).abs().max().item() <= TOL
    assert (reference(moe_zoo / "models" / "qwen3_moe", tokens()) - ours).abs().max().item() > 1e-3, \
        "the SFT steps changed nothing"


# --- TensorRT-LLM mapping (pure torch; the engine itself is tested on GPUs) ----------------------
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "mixtral"])
def test_trtllm_mapping_gives_back_the_hf_tensors(zoo: Path, moe_zoo: Path, name: str):
    """megatron's full dict (read from the HF folder through the import table at TP=1) mapped
    for TensorRT-LLM is the folder's own tensors, under the architecture it runs them as."""
    from safetensors.torch import load_file

    from slurm_align.generation.trtllm_mapping import hf_config, hf_weights, trtllm_tp_slice
    from slurm_align.models.hf.loader import check_hf_folder, megatron_shapes
    from slurm_align.models.hf.mapping import read_shard
    folder = (zoo if name == "qwen3" else moe_zoo) / "models" / name
    cfg = ModelConfig(hf_path=folder)
    checked = check_hf_folder(cfg)
    shapes = megatron_shapes(cfg, False)
    full = {k: read_shard(src, cfg, checked.model_type, checked.files.read, shapes[k], None, 1, 0)
            for k, src in checked.sources.items()}
    mapped = hf_weights(full, cfg)
    want = load_file(str(folder / "model.safetensors"))
    if cfg.tie_embeddings:
        want.pop("lm_head.weight", None)
    assert sorted(mapped) == sorted(want)
    for k in want:
        assert torch.equal(mapped[k], want[k]), k
    assert hf_config(cfg)["architectures"] == json.loads((folder / "config.json").read_text())["architectures"]
    if cfg.num_experts:   # an expert's projections split over TensorRT-LLM's MoE TP like the dense MLP's
        down = next(k for k in want if k.endswith(("experts.0.down_proj.weight", "experts.0.w2.weight")))
        assert trtllm_tp_slice(down, want[down], 2, 1).shape[1] == want[down].shape[1] // 2


@pytest.mark.mpi
def test_moe_gradients_under_expert_parallel_equal_ep1(launched: None, moe_zoo: Path):
    """The same two sequences at EP=1 (one rank, two micro-batches) and at DP=2 x EP=2 (one
    each): after the trainers' reduction every gradient (experts: over their own replicas, the
    rest: over DP) and the global norm (experts summed over EP) are the EP=1 ones."""
    grads = moe_zoo / "grads"
    one, two = torch.load(grads / "grads_ep1.pt"), torch.load(grads / "grads_ep2.pt")
    assert sorted(one["grads"]) == sorted(two["grads"])
    assert any(".experts." in k for k in one["grads"])
    for k, g in one["grads"].items():
        assert g.abs().max() > 0, k
        assert (two["grads"][k] - g).abs().max().item() <= 1e-5 * g.abs().max().item() + 1e-7, k
    assert abs(two["norm"] - one["norm"]) <= 1e-5 * one["norm"]
