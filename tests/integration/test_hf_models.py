"""Hugging Face models in and out, against transformers as the numerical reference.

Tiny random Llama (GQA, untied, Llama-3 RoPE scaling), Qwen2 (QKV bias, tied), Mistral, GPT-2
(learned positions, LayerNorm, gelu_new, Conv1D, tied) and a Llama reward model
(ForSequenceClassification) are made by transformers here and saved with save_pretrained; their
import into megatron on real mpirun ranks (tests/programs/hf_worker.py) must give transformers' logits at
TP=1, TP=2 and PP=2. Round trip: import, 4 SFT steps at TP=2 with the real CLI, export,
transformers loads it. Bad folders and targets are refused with nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurm_align.config.errors import ConfigError
from slurm_align.config.run import ModelConfig

transformers = pytest.importorskip("transformers")

WORKER = Path(__file__).parents[1] / "programs" / "hf_worker.py"
PLAN_WORKER = Path(__file__).parents[1] / "programs" / "plan_worker.py"
ROOT = WORKER.parents[2]   # the repo: tests/programs/x.py -> tests -> repo
TOL = 1e-4
SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=260, max_position_embeddings=64)


def mpirun(n: int, *args: str, timeout: int = 300, worker: Path = WORKER) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "--oversubscribe", "-n", str(n), sys.executable, str(worker), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"


def mpirun_plan(n: int, plan: list[tuple], path: Path) -> None:
    """One mpirun launch of `n` ranks running every (worker, action, tp, pp, ep, dir) of `plan` in
    turn (tests/programs/plan_worker.py): the ranks import megatron once for all these layouts."""
    path.write_text(json.dumps([[*step[:5], str(step[5])] for step in plan]))
    mpirun(n, str(path), worker=PLAN_WORKER)


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return subprocess.run([sys.executable, "-m", "slurm_align.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _perturb(model, seed: int):
    """Random norms and biases too (fresh models have them at 1 and 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def save_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer trained here (259 bytes + specials fill the 260-token vocab)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=260, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["1234=1234", "4321=1234"], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}))


def make_models(root: Path) -> dict[str, Path]:
    t = transformers
    llama3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    models = {
        "llama": t.LlamaForCausalLM(t.LlamaConfig(**SHAPE, rope_scaling=llama3, rope_theta=50000.0)),
        "qwen2": t.Qwen2ForCausalLM(t.Qwen2Config(**SHAPE, tie_word_embeddings=True)),
        "mistral": t.MistralForCausalLM(t.MistralConfig(**SHAPE, sliding_window=64)),
        "gpt2": t.GPT2LMHeadModel(t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=260, n_positions=64,
                                               bos_token_id=0, eos_token_id=0)),
        "llama_rm": t.LlamaForSequenceClassification(t.LlamaConfig(**SHAPE, num_labels=1, pad_token_id=259)),
    }
    out = {}
    for i, (name, model) in enumerate(models.items()):
        out[name] = root / "models" / name
        _perturb(model, i).save_pretrained(out[name])
    save_tokenizer(out["llama"])
    return out


def tokens() -> torch.Tensor:
    return torch.randint(0, 259, (3, 19), generator=torch.Generator().manual_seed(3))


def reference(folder: Path, toks: torch.Tensor) -> torch.Tensor:
    """transformers' own result for the saved folder: logits, or the reward of a *_rm model."""
    with torch.no_grad():
        if folder.name.endswith("_rm"):
            return transformers.AutoModelForSequenceClassification.from_pretrained(folder)(toks).logits[:, 0]
        return transformers.AutoModelForCausalLM.from_pretrained(folder)(toks).logits


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    make_models(root)
    torch.save(tokens(), root / "tokens.pt")
    return root


@pytest.fixture(scope="module")
def launched(zoo: Path) -> Path:
    """This file's rank programs that need nothing but the zoo, all layouts in two launches (one
    rank, two ranks): the logits at TP=1, TP=2 and PP=2, the tied gradients at PP=1 and PP=2,
    slurm-align's own GPT (saved under zoo/own)."""
    (zoo / "own").mkdir()
    torch.save(tokens(), zoo / "own" / "tokens.pt")
    mpirun_plan(1, [("hf", "logits", 1, 1, 1, zoo), ("hf", "tied_grads", 1, 1, 1, zoo),
                    ("hf", "own_gpt", 1, 1, 1, zoo / "own")], zoo / "plan1.json")
    mpirun_plan(2, [("hf", "logits", 2, 1, 1, zoo), ("hf", "logits", 1, 2, 1, zoo),
                    ("hf", "tied_grads", 1, 2, 1, zoo)], zoo / "plan2.json")
    return zoo


@pytest.mark.mpi
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_imported_logits_equal_transformers(launched: Path, tp: int, pp: int):
    zoo = launched
    toks = torch.load(zoo / "tokens.pt")
    for folder in sorted((zoo / "models").iterdir()):
        ours = torch.load(zoo / "out" / f"{folder.name}_tp{tp}_pp{pp}.pt")
        if folder.name.endswith("_rm"):
            ours = ours[:, -1]  # the reward: the value at the last token (no padding here)
        ref = reference(folder, toks)
        assert ours.shape == ref.shape, folder.name
        err = (ours - ref).abs().max().item()
        assert err <= TOL, f"{folder.name} TP={tp} PP={pp}: max |ours - transformers| = {err}"


def import_train_export(hf_dir: Path, tmp_path: Path, steps: int, export: Path) -> Path:
    """`import hf` -> `steps` SFT steps at TP=2 (CLI, local profile) -> `export hf` into `export`;
    returns the trained checkpoint folder."""
    ckpt = tmp_path / "imported"
    proc = cli("import", "hf", str(hf_dir), str(ckpt))
    assert proc.returncode == 0, proc.stderr[-4000:]
    cfg = {"algorithm": "sft", "seed": 1,
           "model": {"hf_path": str(hf_dir), "init_checkpoint": str(ckpt)},
           "actor": {"tensor_parallel": 2, "pipeline_parallel": 1, "data_parallel": 1},
           "data": {"train_path": str(ROOT / "examples/synthetic/sft_train.jsonl")},
           "trainer": {"num_steps": steps, "global_batch_size": 4, "micro_batch_size": 4, "lr": 1e-2,
                       "save_interval": 0, "eval_interval": 0}}
    (tmp_path / "sft.yaml").write_text(json.dumps(cfg))
    run_dir = tmp_path / "run"
    proc = cli("train", "sft", str(tmp_path / "sft.yaml"), "--profile", "local", "--run-dir", str(run_dir), "--follow")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    trained = run_dir / "checkpoints" / "sft" / f"iter_{steps:07d}"
    assert (trained / "manifest.json").is_file()
    proc = cli("export", "hf", str(run_dir / "checkpoints" / "sft"), str(export))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return trained


@pytest.mark.mpi
def test_round_trip_import_train_export(zoo: Path, tmp_path: Path):
    """import -> 4 SFT steps at TP=2 -> export: transformers loads the export and gives the
    trained model's logits; the same weights saved at TP=1 export the very same files."""
    llama = zoo / "models" / "llama"
    trained = import_train_export(llama, tmp_path, steps=4, export=tmp_path / "export_tp2")

    work = tmp_path / "work"
    work.mkdir()
    (work / "hf_dir.txt").write_text(str(llama))
    (work / "ckpt.txt").write_text(str(trained))
    torch.save(tokens(), work / "tokens.pt")
    # slurm-align's logits of the TP=2 checkpoint, and its weights saved again at TP=1
    mpirun(1, "resave", "1", "1", str(work))
    ours = torch.load(work / "trained_logits.pt")
    with torch.no_grad():
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export_tp2")(tokens()).logits
    assert (exported - ours).abs().max().item() <= TOL
    assert (reference(llama, tokens()) - ours).abs().max().item() > 1e-3, "the SFT steps changed nothing"
    proc = cli("export", "hf", str(work / "resaved" / "checkpoints" / "sft"), str(tmp_path / "export_tp1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    names = sorted(p.name for p in (tmp_path / "export_tp2").iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(names)
    assert names == sorted(p.name for p in (tmp_path / "export_tp1").iterdir())
    for name in names:
        a, b = (tmp_path / "export_tp2" / name).read_bytes(), (tmp_path / "export_tp1" / name).read_bytes()
        assert a == b, f"{name} differs between the TP=2 and the TP=1 checkpoint's export"


@pytest.mark.mpi
def test_tied_embedding_gradient_under_pp2(launched: Path):
    """Qwen2's tied embedding at PP=2 (a copy on the last stage): after the trainers' gradient
    reduction both copies hold the PP=1 gradient (input side + output side), so they stay equal."""
    zoo = launched
    want = torch.load(zoo / "tied_pp1_rank0.pt")["embedding"]
    first, last = torch.load(zoo / "tied_pp2_rank0.pt"), torch.load(zoo / "tied_pp2_rank1.pt")
    assert want.abs().max() > 0
    for got in (first["embedding"], last["output_copy"]):
        assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item() + 1e-9


@pytest.mark.mpi
def test_own_gpt_exports_as_gpt2(launched: Path, tmp_path: Path):
    """slurm-align's own GPT (learned positions, LayerNorm, exact GELU, untied) is written as a
    GPT-2 that transformers reproduces; its reward model as GPT2ForSequenceClassification."""
    own = launched / "own"
    for kind in ("lm", "rm"):
        proc = cli("export", "hf", str(own / f"own_{kind}"), str(tmp_path / f"hf_{kind}"))
        assert proc.returncode == 0, proc.stderr[-4000:]
        config = json.loads((tmp_path / f"hf_{kind}" / "config.json").read_text())
        assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu"
        ours = torch.load(own / f"own_{kind}.pt")
        with torch.no_grad():
            if kind == "lm":
                assert config["tie_word_embeddings"] is False
                theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_lm")(tokens()).logits
            else:
                # HF's score head has no bias: ours (0 at init, a constant shift of every reward) is dropped
                theirs = transformers.AutoModelForSequenceClassification.from_pretrained(
                    tmp_path / "hf_rm", pad_token_id=259)(tokens()).logits[:, 0]
                ours = ours[:, -1]
        assert (theirs - ours).abs().max().item() <= TOL, kind


# -- bad input: a clear error naming the file, nothing written ---------------------------------

def _import_refused(hf_dir: Path, out: Path, *expected: str) -> str:
    from slurm_align.models.hf.exporter import import_hf
    with pytest.raises(ConfigError) as e:
        import_hf(hf_dir, out)
    for text in expected:
        assert text in str(e.value), str(e.value)
    assert not out.exists()
    assert not any(p.name.startswith(f".{out.name}") for p in out.parent.iterdir())
    return str(e.value)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_folder_without_config_json(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    _import_refused(tmp_path / "empty", tmp_path / "out", str(tmp_path / "empty" / "config.json"), "no config.json")


def test_unsupported_architecture_lists_supported(zoo: Path, tmp_path: Path):
    folder = _copy(zoo / "models" / "llama", tmp_path / "falcon")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["FalconForCausalLM"]}))
    _import_refused(folder, tmp_path / "out", "FalconForCausalLM", str(folder / "config.json"),
                    "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GPT2LMHeadModel")


def test_missing_and_truncated_shards(zoo: Path, tmp_path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(zoo / "models" / "qwen2")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    missing = _copy(tmp_path / "sharded", tmp_path / "missing")
    (missing / shards[1].name).unlink()
    _import_refused(missing, tmp_path / "out", str(missing / shards[1].name), "missing")
    truncated = _copy(tmp_path / "sharded", tmp_path / "truncated")
    with open(truncated / shards[2].name, "r+b") as f:
        f.truncate(shards[2].stat().st_size - 64)
    _import_refused(truncated, tmp_path / "out", str(truncated / shards[2].name), "truncated")


def test_shape_not_matching_config(zoo: Path, tmp_path: Path):
    folder = _copy(zoo / "models" / "mistral", tmp_path / "wrong")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 40}))
    _import_refused(folder, tmp_path / "out", "model.layers.0.mlp.gate_proj.weight", "[48, 32]", "[40, 32]",
                    "model.safetensors")


def test_export_target_not_empty(tmp_path: Path):
    from slurm_align.models.hf.exporter import export_hf
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        export_hf(tmp_path / "no_such_checkpoint", target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def test_model_fields_from_hf_config(zoo: Path):
    """The architecture comes from config.json; a field given differently is refused."""
    llama = ModelConfig(hf_path=zoo / "models" / "llama")
    assert (llama.position_embedding, llama.normalization, llama.activation) == ("rope", "RMSNorm", "swiglu")
    assert (llama.num_query_groups, llama.kv_channels, llama.tie_embeddings) == (2, 8, False)
    assert llama.rope_scaling.factor == 4.0 and llama.rotary_base == 50000.0 and llama.max_seq_len == 64
    qwen = ModelConfig(hf_path=zoo / "models" / "qwen2")
    assert qwen.add_qkv_bias and not qwen.add_bias_linear and qwen.tie_embeddings
    gpt2 = ModelConfig(hf_path=zoo / "models" / "gpt2")
    assert (gpt2.position_embedding, gpt2.activation, gpt2.add_bias_linear) == ("learned", "gelu_tanh", True)
    with pytest.raises(ValueError, match="conflicts with the folder's value"):
        ModelConfig(hf_path=zoo / "models" / "llama", hidden_size=64)
