"""Tokenised datasets, right-padded batches, and a resumable data order.

Plain rows become [BOS] prompt response [EOS] (no BOS when the tokenizer has none). Chat rows
become the tokenizer's chat template: the prompt is the prompt turns rendered with the
generation prompt (what the policy is given at generation), the response is the rest of the
rendered conversation up to and including its last EOS token (EOS appended when the template
does not end the turn with it, so that generation learns to stop). A row longer than
max_seq_len is an error naming the file, the row and its columns (data.truncate: SFT and
preference rows are cut to max_seq_len instead; prompts never are). A "response mask" marks
the positions whose NEXT token is a response token (where an LM loss/log-prob counts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as CollectionSequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import jinja2
import numpy as np

from slurm_align.config.errors import ConfigError
from slurm_align.data.jsonl import ASSISTANT, Row, column_names, lazy_rows

# torch only where a batch's tensors are made: `slurm-align submit` reads this module to check
# the prompts' lengths before it submits, and importing torch there was half its CPU (1.5 of
# 2.9 CPU-s a submit).
if TYPE_CHECKING:
    import torch


class TemplatePrefixError(ValueError):
    """The chat template renders a conversation without its prompt as a prefix."""


@dataclass(frozen=True)
class Sequence:
    ids: list[int]
    prompt_len: int  # tokens before the response, BOS included
    trained: tuple[int, ...] | None = None
    """Per response token, 1 where the loss counts and 0 on context inside the response (a
    multi-turn output's tool results); None: every response token counts."""


def _bos(tok) -> list[int]:
    return [] if tok.bos_id is None else [tok.bos_id]


def encode_pair(tok, prompt: str, response: str | list[dict], max_len: int) -> Sequence:
    """[BOS] prompt response [EOS]; a multi-turn response (a list of {"role", "content"}
    segments) is its segments' tokens in order, trained only on the assistant's (and EOS)."""
    p = _bos(tok) + tok.encode(prompt)
    if isinstance(response, str):
        ids = (p + tok.encode(response) + [tok.eos_id])[:max_len]
        return Sequence(ids, min(len(p), max_len))
    r, trained = [], []
    for seg in response:
        t = tok.encode(seg["content"])
        r += t
        trained += [int(seg["role"] == ASSISTANT)] * len(t)
    ids = (p + r + [tok.eos_id])[:max_len]
    plen = min(len(p), max_len)
    return Sequence(ids, plen, tuple([*trained, 1][:len(ids) - plen]))


def encode_prompt(tok, prompt: str, max_len: int) -> list[int]:
    return (_bos(tok) + tok.encode(prompt))[:max_len]


def encode_chat_prompt(tok, messages: list[dict], max_len: int) -> list[int]:
    """Prompt turns as the policy sees them: rendered with the generation prompt, no BOS added
    (a template that wants one writes it)."""
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))[:max_len]


def encode_chat_pair(tok, prompt: list[dict], response: list[dict], max_len: int) -> Sequence:
    """Prompt turns + response turns; the response tokens are those of the rendered text past
    the rendered prompt, so training sees exactly what generation produces after the prompt."""
    prompt_text = tok.apply_chat_template(prompt, add_generation_prompt=True)
    full_text = tok.apply_chat_template(prompt + response)
    if not full_text.startswith(prompt_text):
        raise TemplatePrefixError(
            "the chat template renders the conversation without the prompt as its prefix (prompt ends "
            f"{prompt_text[-40:]!r}, conversation has {full_text[:len(prompt_text)][-40:]!r})")
    p = tok.encode(prompt_text)
    r = tok.encode(full_text[len(prompt_text):])
    ends = [i for i, t in enumerate(r) if t == tok.eos_id]
    r = r[: ends[-1] + 1] if ends else [*r, tok.eos_id]   # drop what follows the turn's end ("\n")
    return Sequence((p + r)[:max_len], min(len(p), max_len))


def encode_chat_sft(tok, messages: list[dict], max_len: int) -> Sequence:
    """A chat SFT row: every assistant turn is trained, the turns between them (tool results,
    user turns) and the template's text around them are context. The prompt is what precedes
    the first assistant turn. Each turn's tokens are those of the rendered conversation past the
    text before it, as generation would produce them there; an assistant turn is trained up to
    its end (EOS), what the template writes after that ("\n") is context, or dropped after the
    last turn. One assistant turn: the same sequence as encode_chat_pair."""
    turns = [i for i, m in enumerate(messages) if m.get("role") == ASSISTANT]
    if len(turns) == 1 and turns[0] == len(messages) - 1:
        return encode_chat_pair(tok, messages[:-1], messages[-1:], max_len)

    def rendered_after(prefix: str, conversation: list[dict], gen: bool) -> str:
        text = tok.apply_chat_template(conversation, add_generation_prompt=gen)
        if not text.startswith(prefix):
            raise TemplatePrefixError(
                f"the chat template renders the first {len(conversation)} messages without the earlier "
                f"turns as their prefix (earlier turns end {prefix[-40:]!r})")
        return text

    done = tok.apply_chat_template(messages[:turns[0]], add_generation_prompt=True)
    ids, trained = tok.encode(done), []
    prompt_len = len(ids)
    for i in turns:
        before = rendered_after(done, messages[:i], gen=True)
        context = tok.encode(before[len(done):]) if len(before) > len(done) else []
        done = rendered_after(before, messages[:i + 1], gen=False)
        turn = tok.encode(done[len(before):])
        ends = [k for k, t in enumerate(turn) if t == tok.eos_id]
        cut = ends[-1] + 1 if ends else len(turn)
        last = i == turns[-1]
        tail = [] if last else turn[cut:]
        end = [tok.eos_id] if last and not ends else []
        ids += context + turn[:cut] + end + tail
        trained += [0] * len(context) + [1] * (cut + len(end)) + [0] * len(tail)
    ids = ids[:max_len]
    plen = min(prompt_len, max_len)
    return Sequence(ids, plen, tuple(trained[:len(ids) - plen]))


class TooLong(ValueError):
    """An item longer than it may be; the message says by how much and what to change."""


def fitted(seq: Sequence, row: Row, max_len: int, keys: tuple[str, ...]) -> Sequence:
    """`seq` (encoded with room for max_len + 1 tokens) when it fits max_len, else TooLong."""
    if len(seq.ids) > max_len:
        raise TooLong(f"{row.where}: longer than model.max_seq_len={max_len} tokens "
                      f"({', '.join(map(repr, ('messages',) if row.is_chat else keys))}); shorten it, raise "
                      "model.max_seq_len, or set data.truncate=true to cut such rows to max_seq_len")
    return seq


PROBE_ROWS = 8
"""Rows every rank reads when a data set opens, to find a chat row to try the template on."""


class Encoded(CollectionSequence):
    """Rows encoded on first use and kept: a rank reads (LazyRows) and encodes (tokenizes) only
    the items it touches, so a large data set costs each rank its own share, not the whole set.
    `encoded` counts the rows encoded so far. A template failure or a row too long names the
    file and the row. The first chat row among the first PROBE_ROWS is encoded at once: a
    tokenizer without a chat template fails when the data set opens."""

    def __init__(self, path: Path, rows: CollectionSequence[Row], encode: Callable[[Row], Any]):
        self.path, self.rows, self._encode = path, rows, encode
        self._items: dict[int, Any] = {}
        first_chat = next((i for i in range(min(len(rows), PROBE_ROWS)) if rows[i].is_chat), None)
        if first_chat is not None:
            self[first_chat]

    @property
    def encoded(self) -> int:
        return len(self._items)

    def fetch(self, indices) -> None:
        """Encode the items of `indices` not yet encoded, in file order (a parquet row group is
        then read once for all of a batch's rows in it)."""
        for i in sorted(set(int(i) for i in indices) - self._items.keys()):
            self[i]

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> Any: ...

    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        item = self._items.get(i)
        if item is None:
            item = self._items[i] = self._encode_one(self.rows[i])
        return item

    def _encode_one(self, row: Row) -> Any:
        path = row.path or self.path
        try:
            return self._encode(row)
        except ConfigError as e:   # the tokenizer has no chat template
            raise ConfigError([f"{row.where}: a chat row, but {e}"], path) from None
        except (jinja2.TemplateError, TemplatePrefixError) as e:
            raise ConfigError([f"{row.where}: chat template: {e}"], path) from None
        except TooLong as e:
            raise ConfigError([column_names(str(e), row.columns or {})], path) from None


class _Mapped(CollectionSequence):
    """`fn` of each item of a sequence, computed on access (not cached twice)."""

    def __init__(self, items: CollectionSequence, fn: Callable[[Any], Any]):
        self._items, self._fn = items, fn

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):  # type: ignore[override]  # int -> item, slice -> list, as Encoded
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._fn(self._items[i])


def _where(path: Any) -> Path:
    """The path errors name: the file, or a mixture's description."""
    return Path(getattr(path, "path", path))


class SFTDataset:
    """`path`: a data file, or a data/mixture.py MixtureSpec (its rows drawn from several files).
    truncate: cut rows longer than max_len (data.truncate) instead of refusing them."""

    def __init__(self, path: Any, tok, max_len: int, columns: Mapping[str, str] | None = None,
                 truncate: bool = False):
        cap = max_len if truncate else max_len + 1

        def encode(row: Row) -> Sequence:
            d = row.data
            if row.is_chat:
                return fitted(encode_chat_sft(tok, d["messages"], cap), row, max_len, ())
            return fitted(encode_pair(tok, d["input"], d["output"], cap), row, max_len, ("input", "output"))

        self.rows = lazy_rows(path, "SFT", columns)
        self.items = Encoded(_where(path), self.rows, encode)
        self.pad_id = tok.pad_id

    def __len__(self) -> int:
        return len(self.items)

    def item_tokens(self, indices: list[int]) -> np.ndarray:
        """Tokens of each item (what a micro-batch's token budget counts)."""
        self.items.fetch(indices)
        return np.asarray([len(self.items[i].ids) for i in indices], dtype=np.int64)

    def batch(self, indices: list[int]) -> dict:
        self.items.fetch(indices)
        seqs = [self.items[i] for i in indices]
        tokens, lengths = pad([s.ids for s in seqs], self.pad_id)
        return {"tokens": tokens, "lengths": lengths, "mask": response_mask(seqs, tokens.shape[1])}


class PreferenceDataset:
    """Each item is a (chosen, rejected) pair sharing a prompt (`path`, `truncate`: as SFTDataset)."""

    def __init__(self, path: Any, tok, max_len: int, columns: Mapping[str, str] | None = None,
                 truncate: bool = False):
        cap = max_len if truncate else max_len + 1
        keys = ("prompt", "chosen", "rejected")

        def encode(row: Row) -> tuple[Sequence, Sequence]:
            d = row.data
            if row.is_chat:
                return (fitted(encode_chat_pair(tok, d["messages"], d["chosen"], cap), row, max_len, keys),
                        fitted(encode_chat_pair(tok, d["messages"], d["rejected"], cap), row, max_len, keys))
            return (fitted(encode_pair(tok, d["prompt"], d["chosen"], cap), row, max_len, keys),
                    fitted(encode_pair(tok, d["prompt"], d["rejected"], cap), row, max_len, keys))

        self.path = _where(path)
        self.rows = lazy_rows(path, "preference", columns)
        self.items = Encoded(self.path, self.rows, encode)
        self.chosen = _Mapped(self.items, lambda pair: pair[0])
        self.rejected = _Mapped(self.items, lambda pair: pair[1])
        self.pad_id = tok.pad_id
        self.rewards = _Mapped(self.rows, lambda row: _pair_rewards(row, row.path or self.path))

    def __len__(self) -> int:
        return len(self.rows)

    def item_tokens(self, indices: list[int]) -> np.ndarray:
        """Tokens of each pair (chosen + rejected: they share a micro-batch)."""
        self.items.fetch(indices)
        return np.asarray([len(self.chosen[i].ids) + len(self.rejected[i].ids) for i in indices], dtype=np.int64)

    def batch(self, indices: list[int]) -> dict:
        """tokens [2n, s]: the n chosen sequences, then the n rejected ones, in the same order."""
        self.items.fetch(indices)
        seqs = [self.chosen[i] for i in indices] + [self.rejected[i] for i in indices]
        tokens, lengths = pad([s.ids for s in seqs], self.pad_id)
        # "rewards" [2n]: the rows' optional chosen_reward / rejected_reward (NaN where absent;
        # the losses that read them fill in their configured defaults)
        rewards = [self.rewards[i][0] for i in indices] + [self.rewards[i][1] for i in indices]
        import torch

        return {"tokens": tokens, "lengths": lengths, "mask": response_mask(seqs, tokens.shape[1]),
                "rewards": torch.tensor(rewards, dtype=torch.float64)}


def _pair_rewards(row: Row, path: str | Path) -> tuple[float, float]:
    """A preference row's optional ground-truth "chosen_reward" / "rejected_reward" (NaN where
    absent: the losses that read them fill in their configured defaults)."""
    out = []
    for key in ("chosen_reward", "rejected_reward"):
        v = row.extra.get(key, row.data.get(key))
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise ConfigError([f"{row.where}: {key!r} must be a number, got {v!r}"], path)
        out.append(float("nan") if v is None else float(v))
    return out[0], out[1]


def row_fields(row: Row) -> dict:
    """A prompt row as a rule reward or scorer reads it: "prompt" (a chat row's last user turn)
    and the row's other fields (e.g. a reference answer)."""
    if row.is_chat:
        users = [m["content"] for m in row.data["messages"] if m.get("role") == "user"]
        prompt = {"prompt": users[-1] if users else "", "messages": row.data["messages"]}
    else:
        prompt = dict(row.data)
    return {**row.extra, **prompt}


class PromptDataset:
    """Prompt token ids (PPO's prompts): plain rows as [BOS] prompt, chat rows rendered; each
    prompt is read and encoded when first used (LazyRows, Encoded). `path`: a data file or a
    data/mixture.py MixtureSpec. A prompt must leave `reserve` tokens (generation.max_new_tokens)
    of max_len: a longer one is an error naming the file, the row and the column, never cut.
    `suffix` is appended to every plain prompt before encoding (SteerLM's rendered attributes,
    eval.attributes); the rows (fields()) keep the prompt as written, which is what scorers read."""

    def __init__(self, path: Any, tok, max_len: int, columns: Mapping[str, str] | None = None,
                 reserve: int = 0, suffix: str = ""):
        limit = max_len - reserve

        def encode(row: Row) -> list[int]:
            if row.is_chat:
                if suffix:   # SteerLM's attributes (eval.attributes) condition a plain prompt's text
                    raise ValueError(f"{row.where}: eval.attributes conditions plain 'prompt' rows, not chat "
                                     "'messages'")
                ids = encode_chat_prompt(tok, row.data["messages"], limit + 1)
            else:
                ids = encode_prompt(tok, row.data["prompt"] + suffix, limit + 1)
            if len(ids) > limit:
                raise TooLong(f"{row.where}: the prompt ({'messages' if row.is_chat else repr('prompt')}) has more "
                              f"than {limit} tokens, the most that leaves generation.max_new_tokens={reserve} of "
                              f"model.max_seq_len={max_len}; shorten or drop it, or raise model.max_seq_len")
            return ids

        self.rows = lazy_rows(path, "prompt", columns)
        self.items = Encoded(_where(path), self.rows, encode)

    def __len__(self) -> int:
        return len(self.items)

    def token_arrays(self) -> _Mapped:
        """The prompts as int64 arrays (what the generation engines take), encoded on access."""
        return _Mapped(self.items, lambda ids: np.asarray(ids, dtype=np.int64))

    def fields(self) -> _Mapped:
        """Each row as a rule reward or scorer reads it (row_fields), read on access."""
        return _Mapped(self.rows, row_fields)


def pad(seqs: list[list[int]], pad_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    length = length or max(len(s) for s in seqs)
    out = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out, torch.tensor([len(s) for s in seqs], dtype=torch.long)


def response_mask(seqs: list[Sequence], length: int) -> torch.Tensor:
    """[n, length-1] float: 1 where position t predicts a response token t+1."""
    import torch

    from slurm_align.data.positions import position_mask

    plen = torch.tensor([s.prompt_len for s in seqs], dtype=torch.int64)
    rlen = torch.tensor([len(s.ids) for s in seqs], dtype=torch.int64) - plen
    mask = position_mask(plen, rlen, length - 1)
    for i, s in enumerate(seqs):   # context inside a multi-turn response: position p predicts token p+1
        if s.trained is not None:
            for t, keep in enumerate(s.trained):
                p = s.prompt_len + t - 1   # -1: an empty prompt's first token, which nothing predicts
                if not keep and 0 <= p < length - 1:
                    mask[i, p] = 0
    return mask


class DataOrder:
    """Which samples each step uses: a seeded permutation per epoch, a pure function of the
    step, so resuming at step k reproduces exactly the batches an uninterrupted run would see."""

    def __init__(self, n: int, global_batch: int, seed: int):
        self.n, self.global_batch, self.seed = n, global_batch, seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            import torch

            g = torch.Generator().manual_seed(self.seed + 7919 * epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).tolist()}
        return self._perms[epoch]

    def global_indices(self, step: int) -> list[int]:
        start = step * self.global_batch
        return [self._perm(i // self.n)[i % self.n] for i in range(start, start + self.global_batch)]

    def rank_indices(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        idx = self.global_indices(step)
        per = len(idx) // dp_size
        return idx[dp_rank * per : (dp_rank + 1) * per]
