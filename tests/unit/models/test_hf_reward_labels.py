"""A Hugging Face *ForSequenceClassification reward model with several outputs (num_labels > 1,
a regression reward model such as NVIDIA's HelpSteer2 ones): imported into slurm-align's value
head it scores like transformers (the numerical reference), and exported back transformers
loads the same scores. In this process on a one-rank world, one tiny Llama."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slurm_align.config.errors import ConfigError
from slurm_align.config.run import ModelConfig
from slurm_align.models.forward import forward_values, last_token_values
from slurm_align.models.gpt import build_gpt
from slurm_align.models.hf.config import hf_config_dict
from slurm_align.models.hf.loader import check_hf_folder
from slurm_align.models.hf.mapping import sources, to_hf
from slurm_align.models.weights import local_tensors
from tests.support.single_rank import single_rank_world

transformers = pytest.importorskip("transformers")
SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=260, max_position_embeddings=64)
LABELS = 3
TOL = 1e-4


@pytest.fixture(scope="module")
def pctx() -> Iterator:
    with single_rank_world() as (_, p):
        yield p


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(**SHAPE, num_labels=LABELS, pad_token_id=259))
    with torch.no_grad():
        for p in model.parameters():   # norms and the score head away from their fresh values
            p.add_(0.05 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("hf") / "llama_rm3"
    model.save_pretrained(out)
    return out


def hf_scores(model, toks: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(toks).logits   # [b, num_labels] at each row's last token (no padding here)


def test_import_and_export_of_a_reward_model_with_three_outputs(pctx, folder: Path, tmp_path: Path):
    cfg = ModelConfig(hf_path=folder)
    assert cfg.num_labels == LABELS   # filled from the folder's id2label
    toks = torch.randint(0, 259, (3, 11), generator=torch.Generator().manual_seed(3))
    theirs = hf_scores(transformers.AutoModelForSequenceClassification.from_pretrained(folder), toks)
    assert theirs.shape == (3, LABELS)

    chunks = build_gpt(cfg, pctx, value_head=True)
    values = forward_values(chunks, pctx, toks, num_labels=LABELS)
    ours = last_token_values(values, torch.full((3,), 11))
    assert ours.shape == (3, LABELS)
    assert torch.allclose(ours, theirs, atol=TOL), (ours, theirs)

    # export: the value head's N rows become score.weight [N, h] and config.json says N labels
    full = {name: t.detach() for name, t in local_tensors(chunks, pctx)}
    state = {k: v for name, src in sources(cfg, "llama", value_head=True, score_head=True).items()
             for k, v in to_hf(src, full[name], cfg, "llama").items()}
    config = hf_config_dict(cfg, "llama", json.loads((folder / "config.json").read_text()), value_head=True)
    assert config["num_labels"] == LABELS and config["architectures"] == ["LlamaForSequenceClassification"]
    back = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**config))
    missing, unexpected = back.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    assert torch.allclose(hf_scores(back, toks), theirs, atol=TOL)


def test_a_label_count_that_does_not_match_is_refused(folder: Path):
    with pytest.raises(ValueError, match=r"model\.num_labels=1 conflicts with the folder's 3 label"):
        ModelConfig.model_validate({"hf_path": str(folder), "num_labels": 1})
    with pytest.raises(ConfigError, match="has 3 label"):   # a folder checked against a config saying 2
        check_hf_folder(ModelConfig(hf_path=folder).model_copy(update={"num_labels": 2}), value_head=True)
