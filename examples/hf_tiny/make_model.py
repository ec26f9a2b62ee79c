"""Make a tiny Llama-architecture Hugging Face model folder and chat-row data for examples/hf_tiny.

    .venv/bin/python examples/hf_tiny/make_model.py [OUT_DIR]     (default examples/hf_tiny/model)

Nothing is downloaded: the model is a random LlamaForCausalLM (GQA, RoPE, RMSNorm, SwiGLU) from
transformers, the tokenizer a byte-level BPE trained here with `tokenizers` on the synthetic
task's text, with a chat template in tokenizer_config.json. Both are written the way a hub model
folder holds them (config.json, model.safetensors, tokenizer.json, tokenizer_config.json). The
synthetic task's SFT pairs, preferences and prompts are also written as chat rows
({"messages": [...]}) into examples/hf_tiny/data/.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).resolve().parent
SYNTHETIC = HERE.parent / "synthetic"
SPECIALS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
# Each turn: its role tag, the text, the end-of-sequence token; the generation prompt opens an
# assistant turn (so a response ends with </s>, where generation stops).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def train_tokenizer(texts: list[str], vocab_size: int = 320) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    # As Llama's tokenizer: encoding with special tokens puts <s> first.
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return tok


def chat_data(out: Path) -> None:
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    assistant = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    for split in ("train", "val"):
        write_jsonl(out / f"sft_{split}.jsonl", [{"messages": user(r["input"]) + assistant(r["output"])}
                                                 for r in read_jsonl(SYNTHETIC / f"sft_{split}.jsonl")])
        write_jsonl(out / f"pref_{split}.jsonl", [{"messages": user(r["prompt"]), "chosen": assistant(r["chosen"]),
                                                   "rejected": assistant(r["rejected"])}
                                                  for r in read_jsonl(SYNTHETIC / f"pref_{split}.jsonl")])
    write_jsonl(out / "prompts.jsonl",
                [{"messages": user(r["prompt"])} for r in read_jsonl(SYNTHETIC / "prompts.jsonl")])


def main(out_dir: Path) -> None:
    texts = [r["input"] + r["output"] for r in read_jsonl(SYNTHETIC / "sft_train.jsonl")]
    tok = train_tokenizer(texts)
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "model_max_length": 64, "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    chat_data(HERE / "data")
    print(f"wrote {out_dir} (vocab {tok.get_vocab_size()}) and {HERE / 'data'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "model")
