"""Chat templates render as transformers' apply_chat_template; chat rows in the datasets.

Tokenizers are trained here with `tokenizers` and saved by transformers (save_pretrained), so
the folders look as a Hub model's do (tokenizer.json, tokenizer_config.json, chat_template.jinja).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from slurm_align.config.errors import ConfigError  # noqa: E402
from slurm_align.config.run import ModelConfig  # noqa: E402
from slurm_align.data.datasets import PreferenceDataset, PromptDataset, SFTDataset, encode_prompt  # noqa: E402
from slurm_align.models.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer  # noqa: E402

# Llama-3.1 style: bos_token, header tokens, a default system turn with strftime_now, <|eot_id|>.
LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- \"Year: \" + strftime_now(\"%Y\") + \"\\n\\n\" }}\n"
    "{{- system_message }}\n"
    "{{- \"<|eot_id|>\" }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# Qwen2.5 style ChatML: a default system turn, tojson, namespace, loop controls.
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(turns=0) %}\n"
    "{%- for message in messages %}\n"
    "    {%- if loop.first and message.role == 'system' %}{% continue %}{% endif %}\n"
    "    {%- set ns.turns = ns.turns + 1 %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' + message.content }}\n"
    "    {%- if message.meta is defined %}{{ ' ' + message.meta | tojson }}{% endif %}\n"
    "    {{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Mistral / Llama-2 style: bos_token, [INST], eos_token after answers, raise_exception; written
# without whitespace control, so it renders right only with trim_blocks and lstrip_blocks.
INST = (
    "{{ bos_token }}\n"
    "{% for message in messages %}\n"
    "    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {% endif %}\n"
    "    {% if message['role'] == 'user' %}\n"
    "[INST] {{ message['content'] }} [/INST]\n"
    "    {% elif message['role'] == 'assistant' %}\n"
    "{{ message['content'] + eos_token }}\n"
    "    {% endif %}\n"
    "{% endfor %}\n"
)

CORPUS = ["You are a helpful assistant.", "What is two plus two?", "Two plus two is four.",
          "Sort these digits: 7 3 9 1", "1 3 7 9", "Thanks! <b>bold</b> & \"quotes\" é ü"] * 20

CONVERSATIONS = [
    [{"role": "user", "content": "What is two plus two?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Two plus two is four."}],
    [{"role": "user", "content": "Sort these digits: 7 3 9 1"},
     {"role": "assistant", "content": "1 3 7 9"},
     {"role": "user", "content": "Thanks! <b>bold</b> & \"quotes\" é ü", "meta": {"tag": "<x>&"}}],
]


def make_tokenizer(folder: Path, template: str, specials: dict[str, str], names: list[str]) -> Path:
    """A byte-level BPE trained on CORPUS, saved by transformers with `specials` and `template`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=names,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **specials)
    fast.save_pretrained(folder)
    return folder


LLAMA3_NAMES = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML_NAMES = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
INST_NAMES = ["<unk>", "<s>", "</s>"]
STYLES = {
    # add_bos_token: tokenizer.json's post-processor prepends BOS, as Llama 3's does
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True},
               LLAMA3_NAMES),
    "chatml": (CHATML, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, CHATML_NAMES),
    "inst": (INST, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, INST_NAMES),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {name: make_tokenizer(root / name, *spec) for name, spec in STYLES.items()}


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("gen_prompt", [False, True])
def test_render_equals_apply_chat_template(folders, style: str, gen_prompt: bool):
    ref = transformers.AutoTokenizer.from_pretrained(folders[style])
    ours = HFTokenizer(folders[style])
    convs = CONVERSATIONS if style != "inst" else [CONVERSATIONS[0], CONVERSATIONS[2]]
    for conv in convs:
        want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen_prompt)
        got = ours.apply_chat_template(conv, add_generation_prompt=gen_prompt)
        assert got == want
        want_ids = ref.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen_prompt)
        want_ids = want_ids["input_ids"] if isinstance(want_ids, dict) or hasattr(want_ids, "keys") else want_ids
        assert ours.encode(got) == list(want_ids)


def test_special_tokens_from_tokenizer_config(folders):
    for style, (_, _specials, _) in STYLES.items():
        ref = transformers.AutoTokenizer.from_pretrained(folders[style])
        ours = HFTokenizer(folders[style] / "tokenizer.json")   # the file, its folder read beside it
        assert ours.eos_id == ref.eos_token_id
        assert ours.pad_id == (ref.pad_token_id if ref.pad_token_id is not None else ref.eos_token_id)
        assert ours.special_tokens == ref.special_tokens_map
        # plain rows start as transformers tokenizes text: BOS only where the tokenizer adds it
        for text in CORPUS[:6]:
            assert encode_prompt(ours, text, 64) == ref(text)["input_ids"]
        assert (ours.bos_id is not None) == (style == "llama3")
    inst = HFTokenizer(folders["inst"])
    assert "{{ bos_token }}" in inst.chat_template
    assert inst.apply_chat_template(CONVERSATIONS[0]).startswith("<s>\n[INST] ")


def test_template_errors_and_raise_exception(folders):
    ours = HFTokenizer(folders["inst"])
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        ours.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_rows_in_sft_preference_and_prompt_datasets(folders, tmp_path: Path):
    tok = HFTokenizer(folders["chatml"])
    ref = transformers.AutoTokenizer.from_pretrained(folders["chatml"])
    conv = CONVERSATIONS[1]
    sft = SFTDataset(_jsonl(tmp_path / "sft.jsonl", [{"messages": conv}, {"input": "2+2=", "output": "4"}]),
                     tok, max_len=256)
    prompt_ids = ref.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    item = sft.items[0]
    assert item.ids[: item.prompt_len] == prompt_ids
    # the response: the assistant's content and the turn's end (EOS = <|im_end|>); the "\n" after it is dropped
    assert tok.decode(item.ids[item.prompt_len:]) == conv[-1]["content"]
    assert item.ids[-1] == tok.eos_id and item.ids.count(tok.eos_id) == 3
    b = sft.batch([0])
    assert b["mask"][0].sum() == len(item.ids) - item.prompt_len
    # plain row: no BOS (the ChatML tokenizer has none), EOS appended
    plain = sft.items[1]
    assert plain.ids == [*tok.encode("2+2="), *tok.encode("4"), tok.eos_id]
    assert plain.prompt_len == len(tok.encode("2+2="))

    pref = PreferenceDataset(_jsonl(tmp_path / "pref.jsonl", [
        {"messages": conv[:-1], "chosen": "Two plus two is four.",
         "rejected": {"role": "assistant", "content": "Five."}},
        {"messages": conv[:-1], "chosen": [conv[-1]], "rejected": "4"}]), tok, max_len=256)
    assert pref.chosen[0] == pref.chosen[1] == item
    assert pref.rejected[0].ids[: item.prompt_len] == prompt_ids
    assert tok.decode(pref.rejected[0].ids[item.prompt_len:]) == "Five."

    prompts = PromptDataset(_jsonl(tmp_path / "p.jsonl", [{"messages": conv[:-1], "answer": "4"}, {"prompt": "x"}]),
                            tok, max_len=256)
    assert prompts.items[0] == prompt_ids and prompts.rows[0].extra == {"answer": "4"}
    # what PPO's engines and a rule reward get: int64 ids; "prompt" (a chat row's last user turn) + other fields
    assert [a.tolist() for a in prompts.token_arrays()] == prompts.items[:]
    assert prompts.token_arrays()[0].dtype == np.int64
    chat_fields, plain_fields = prompts.fields()
    assert chat_fields["prompt"] == [m for m in conv[:-1] if m["role"] == "user"][-1]["content"]
    assert chat_fields["answer"] == "4" and chat_fields["messages"] == conv[:-1]
    assert plain_fields == {"prompt": "x"}


TOOL_CONVERSATION = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Sort these digits: 7 3 9 1"},
    {"role": "tool", "content": "1 3 7 9"},
    {"role": "assistant", "content": "Two plus two is four."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "1 3 7 9"},
]


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_a_multi_turn_chat_row_trains_every_assistant_turn_and_nothing_else(folders, tmp_path: Path, style):
    tok = HFTokenizer(folders[style])
    ref = transformers.AutoTokenizer.from_pretrained(folders[style])
    sft = SFTDataset(_jsonl(tmp_path / "sft.jsonl", [{"messages": TOOL_CONVERSATION}]), tok, max_len=512)
    item = sft.items[0]
    # the sequence is the rendered conversation (up to the last turn's end), the prompt its first turn
    text = lambda ids: ref.decode(ids, skip_special_tokens=False)   # noqa: E731
    full, eot = ref.apply_chat_template(TOOL_CONVERSATION, tokenize=False), text([tok.eos_id])
    assert text(item.ids) == full[: full.rindex(eot) + len(eot)]
    assert text(item.ids[:item.prompt_len]) == ref.apply_chat_template(
        TOOL_CONVERSATION[:1], add_generation_prompt=True, tokenize=False)
    # trained: exactly the three assistant turns, each with its end; tool and user turns are context
    response = item.ids[item.prompt_len:]
    runs, current = [], []
    for token, keep in zip(response, item.trained, strict=True):
        if keep:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs.append(current)
    assert [text(r) for r in runs] == [m["content"] + eot for m in TOOL_CONVERSATION if m["role"] == "assistant"]
    # the loss mask: position p predicts token p+1, so it counts exactly the trained tokens
    assert sft.batch([0])["mask"][0].sum() == sum(item.trained)


def test_llama3_response_ends_at_eot_and_eos_appended_when_template_lacks_it(folders, tmp_path: Path):
    llama = HFTokenizer(folders["llama3"])
    conv = CONVERSATIONS[1]
    item = SFTDataset(_jsonl(tmp_path / "a.jsonl", [{"messages": conv}]), llama, 256).items[0]
    assert item.ids[0] == llama.bos_id and item.ids.count(llama.bos_id) == 1   # the template's BOS only
    assert llama.decode(item.ids[item.prompt_len:]) == conv[-1]["content"] and item.ids[-1] == llama.eos_id
    # a ChatML template with a tokenizer whose EOS is <|endoftext|>: the turn ends <|im_end|>\n, then EOS
    folder = make_tokenizer(tmp_path / "base", CHATML, {"eos_token": "<|endoftext|>"}, CHATML_NAMES)
    base = HFTokenizer(folder)
    item = SFTDataset(_jsonl(tmp_path / "b.jsonl", [{"messages": conv}]), base, 256).items[0]
    resp = item.ids[item.prompt_len:]
    assert resp[-1] == base.eos_id and resp[:-1] == base.encode(conv[-1]["content"] + "<|im_end|>\n")


@pytest.mark.parametrize("kind,row,expected", [
    ("SFT", {"messages": [{"role": "user", "content": "q"}]}, r"line 1: the last message of an SFT chat row"),
    ("SFT", {"messages": []}, r"line 1: 'messages' must be a non-empty list"),
    ("SFT", {"messages": [{"role": "user"}]}, r"line 1: messages\[0\] needs string 'content'"),
    ("prompt", {"messages": [{"role": "assistant", "content": "a"}]}, r"line 1: .*must be a prompt turn"),
    ("preference", {"messages": [{"role": "user", "content": "q"}], "chosen": "a"}, r"line 1: missing key 'rejected'"),
    ("preference", {"messages": [{"role": "user", "content": "q"}], "chosen": 3, "rejected": "b"},
     r"line 1: 'chosen' must be a non-empty list"),
])
def test_bad_chat_rows_name_file_and_line(folders, tmp_path: Path, kind, row, expected):
    path = _jsonl(tmp_path / "bad.jsonl", [row])
    cls = {"SFT": SFTDataset, "prompt": PromptDataset, "preference": PreferenceDataset}[kind]
    with pytest.raises(ConfigError, match=expected) as e:
        cls(path, HFTokenizer(folders["chatml"]), 64)
    assert str(path) in str(e.value)


def test_chat_rows_need_a_chat_template(folders, tmp_path: Path):
    path = _jsonl(tmp_path / "s.jsonl", [{"input": "a", "output": "b"}, {"messages": CONVERSATIONS[1]}])
    with pytest.raises(ConfigError, match=r"s.jsonl: line 2: a chat row, but .*byte tokenizer has no chat template"):
        SFTDataset(path, ByteTokenizer(), 64)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(folders["chatml"] / "tokenizer.json", bare / "tokenizer.json")
    with pytest.raises(ConfigError,
                       match=r"line 2: a chat row, but .*tokenizer.json: this tokenizer has no chat template"):
        SFTDataset(path, HFTokenizer(bare), 64)
    # a template error (roles must alternate) names the data file and line
    bad = _jsonl(tmp_path / "t.jsonl",
                 [{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}])
    with pytest.raises(ConfigError, match=r"t.jsonl: line 1: chat template: .*must alternate"):
        PromptDataset(bad, HFTokenizer(folders["inst"]), 64)
    # a template that does not render the prompt as the conversation's prefix cannot split it
    last_only = make_tokenizer(tmp_path / "last", "{{ messages[-1]['content'] }}", {"eos_token": "<|im_end|>"},
                               CHATML_NAMES)
    with pytest.raises(ConfigError, match=r"s.jsonl: line 2: chat template: .*without the prompt as its prefix"):
        SFTDataset(path, HFTokenizer(last_only), 64)


def test_bad_tokenizer_folders_are_clear_errors(folders, tmp_path: Path):
    def folder_with(config: dict) -> Path:
        d = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        shutil.copy(folders["chatml"] / "tokenizer.json", d / "tokenizer.json")
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        return d

    with pytest.raises(ConfigError, match=r"tokenizer_config.json: no eos_token"):
        HFTokenizer(folder_with({"pad_token": "<|endoftext|>"}))
    with pytest.raises(ConfigError,
                       match=r"tokenizer_config.json: field 'eos_token': got '<\|eot_id\|>'; is not a token"):
        HFTokenizer(folder_with({"eos_token": "<|eot_id|>"}))
    with pytest.raises(ConfigError, match=r"tokenizer_config.json: field 'chat_template'.*not a valid Jinja"):
        HFTokenizer(folder_with({"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}"}))
    with pytest.raises(ConfigError, match=r"none named 'default'"):
        HFTokenizer(folder_with({"eos_token": "<|im_end|>", "chat_template": [{"name": "tool_use", "template": "x"}]}))
    d = folder_with({"eos_token": "<|im_end|>", "chat_template": [{"name": "default", "template": "{{ eos_token }}"}]})
    assert HFTokenizer(d).apply_chat_template([{"role": "user", "content": "a"}]) == "<|im_end|>"
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokenizer_config.json.*cannot read it as JSON"):
        HFTokenizer(d)
    with pytest.raises(ConfigError, match=r"model.tokenizer.path.*no such file"):
        HFTokenizer(tmp_path / "nowhere")
    # pad falls back to EOS; the vocabulary must fit the model
    tok = HFTokenizer(folder_with({"eos_token": "<|im_end|>"}))
    assert tok.pad_id == tok.eos_id and tok.bos_id is None
    with pytest.raises(ConfigError, match=r"model.vocab_size.*has 300 tokens"):
        build_tokenizer(ModelConfig(vocab_size=200, tokenizer={"kind": "hf", "path": str(folders["chatml"])}))


def test_model_hf_path_brings_its_tokenizer(folders, tmp_path: Path):
    folder = tmp_path / "model"
    shutil.copytree(folders["llama3"], folder)
    transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4).save_pretrained(folder)
    tok = build_tokenizer(ModelConfig(hf_path=folder))
    assert isinstance(tok, HFTokenizer) and tok.chat_template == LLAMA3
    assert tok.apply_chat_template(CONVERSATIONS[0]).startswith("<|begin_of_text|><|start_header_id|>system")
