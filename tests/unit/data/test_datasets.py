"""JSONL formats: malformed files give errors naming file, line and problem; batching."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_align.config.errors import ConfigError
from slurm_align.data.datasets import DataOrder, PreferenceDataset, SFTDataset
from slurm_align.data.jsonl import PREFERENCE_KEYS, SFT_KEYS, read_jsonl
from slurm_align.data.synthetic import score
from slurm_align.models.tokenizer import ByteTokenizer

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "synthetic"


@pytest.mark.parametrize("content,expected", [
    ('{"input": "a", "output": "b"}\n{"input": "a", "output": \n', r"line 2: not valid JSON"),
    ('{"input": "a"}\n', r"line 1: missing key\(s\) \['output'\]"),
    ('{"input": "a", "output": 3}\n', r"line 1: values must be strings: 'output' is int"),
    ('["input", "output"]\n', r"line 1: expected a JSON object"),
    ("\n  \n", r"SFT data file is empty"),
    ('{"input": "a", "output": [{"role": "tool", "content": "1"}]}\n',
     r"line 1: 'output' has no 'assistant' segment: nothing to train on"),
    ('{"input": "a", "output": [{"role": "assistant"}]}\n', r"line 1: output\[0\] needs string 'content'"),
])
def test_malformed_sft_files_name_file_line_and_problem(tmp_path: Path, content: str, expected: str):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=expected) as e:
        read_jsonl(path, SFT_KEYS, "SFT")
    assert str(path) in str(e.value)


def test_missing_file_and_several_problems_reported_together(tmp_path: Path):
    with pytest.raises(ConfigError, match="preference data file not found"):
        read_jsonl(tmp_path / "nope.jsonl", PREFERENCE_KEYS, "preference")
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x"}\nnot json\n{"prompt": "x", "chosen": "a", "rejected": "b"}\n')
    with pytest.raises(ConfigError) as e:
        read_jsonl(path, PREFERENCE_KEYS, "preference")
    assert "2 problems" in str(e.value) and "line 1" in str(e.value) and "line 2" in str(e.value)


def test_sft_mask_covers_response_and_eos_only(tmp_path: Path):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"input": "ab=", "output": "xy"}) + "\n")
    ds = SFTDataset(path, ByteTokenizer(), max_len=32)
    b = ds.batch([0])
    assert b["tokens"][0].tolist() == [256, 97, 98, 61, 120, 121, 257]
    # position t predicts t+1: positions 3,4,5 predict 'x', 'y', EOS
    assert b["mask"][0].tolist() == [0, 0, 0, 1, 1, 1]


def test_multi_turn_sft_output_trains_only_the_assistant_segments(tmp_path: Path):
    """A tool's result inside the answer is context: the loss counts the assistant's segments
    and EOS, not the tool's tokens (which the model never generates)."""
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"input": "ab=", "output": [
        {"role": "assistant", "content": "x"}, {"role": "tool", "content": "yz"},
        {"role": "assistant", "content": "w"}]}) + "\n")
    b = SFTDataset(path, ByteTokenizer(), max_len=32).batch([0])
    assert b["tokens"][0].tolist() == [256, 97, 98, 61, 120, 121, 122, 119, 257]
    # positions 3..7 predict x, y, z, w, EOS: y and z are the tool's
    assert b["mask"][0].tolist() == [0, 0, 0, 1, 0, 0, 1, 1]


def test_context_token_that_nothing_predicts_masks_nothing():
    """An empty prompt without BOS: the response's first token has no predicting position, so
    its being context must not clear another position (index -1 is the last column)."""
    from slurm_align.data.datasets import Sequence, response_mask

    mask = response_mask([Sequence([5, 6, 7], 0, (0, 1, 1))], 3)
    assert mask[0].tolist() == [1, 1]


def test_preference_batch_keeps_pairs_aligned():
    ds = PreferenceDataset(EXAMPLES / "pref_val.jsonl", ByteTokenizer(), max_len=32)
    b = ds.batch([0, 1])
    assert b["tokens"].shape[0] == 4
    tok = ByteTokenizer()
    assert tok.decode(b["tokens"][0]).endswith(ds.rows[0].data["chosen"])
    assert tok.decode(b["tokens"][2]).endswith(ds.rows[0].data["rejected"])


def test_data_order_is_a_function_of_the_step():
    a, b = DataOrder(100, 16, seed=3), DataOrder(100, 16, seed=3)
    assert a.global_indices(9) == b.global_indices(9)   # resume needs no other state
    first_epoch = [i for s in range(7) for i in a.global_indices(s)][:100]
    assert sorted(first_epoch) == list(range(100))
    assert a.rank_indices(2, 0, 2) + a.rank_indices(2, 1, 2) == a.global_indices(2)


def test_synthetic_scorer_and_shipped_files():
    assert score("0123") == 1.0 and score("3210") == 0.0 and score("ab") == 0.0
    assert 0.0 < score("1302") < 1.0
    rows = read_jsonl(EXAMPLES / "pref_train.jsonl", PREFERENCE_KEYS, "preference")
    assert all(score(r["chosen"]) == 1.0 for r in rows)
    assert sum(score(r["rejected"]) for r in rows) / len(rows) < 0.7


PROMPT_CHECK = """
import sys
from slurm_align import REPO_ROOT
from slurm_align.config import load_run_config
from slurm_align.config.loading import check_prompt_lengths
run = load_run_config(REPO_ROOT / "examples" / "grpo_tiny.yaml")
check_prompt_lengths(run, REPO_ROOT / "examples" / "synthetic" / "prompts.jsonl")
print(sorted(m for m in ("torch", "megatron.core") if m in sys.modules))
"""


def test_the_prompt_check_before_a_submit_imports_no_torch():
    """`slurm-align submit` tokenizes the run's prompts with this module's encoders to check their
    lengths (config/loading.py check_prompt_lengths) before it submits. torch is imported only
    where a batch's tensors are made: importing it there was half of a submit's CPU (2.9 -> 1.1
    CPU-s, and every test that submits through the CLI paid it)."""
    proc = subprocess.run([sys.executable, "-c", PROMPT_CHECK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
