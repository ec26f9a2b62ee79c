"""Tool calls in a model turn: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
the format Qwen2.5's and Hermes-style chat templates render an assistant's tool_calls in.

A turn ends at a stop sequence (by default "</tool_call>"); engines differ in whether the stop
text stays in the output, so a last block left open at the end of the turn counts as closed.
The model's text is hostile input: every block becomes a ToolCall or a BadCall that says what is
wrong with it, never an exception.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class BadCall:
    """A block that is not a call: `problem` is the error observation the model will read."""

    text: str
    problem: str


def _parse_block(body: str) -> ToolCall | BadCall:
    text = body.strip()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BadCall(text, f"the tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                             'expected {"name": "<tool>", "arguments": {...}}')
    if not isinstance(obj, dict):
        return BadCall(text, f"the tool call is a JSON {type(obj).__name__}, not an object "
                             '{"name": "<tool>", "arguments": {...}}')
    # Llama 3.1's templates name them "parameters"
    name, arguments = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return BadCall(text, 'the tool call has no "name" (a string naming the tool)')
    if isinstance(arguments, str):    # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return BadCall(text, f'the "arguments" of tool {name!r} must be a JSON object, got {type(arguments).__name__}')
    extra = sorted(set(obj) - {"name", "arguments", "parameters"})
    if extra or {"arguments", "parameters"} <= set(obj):
        return BadCall(text, f"the tool call has keys {sorted(obj)}; expected \"name\" and \"arguments\"")
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall | BadCall]]:
    """The turn's text before its first call, and its calls in order (none: a final answer)."""
    calls = [_parse_block(m.group(1)) for m in _BLOCK.finditer(text)]
    head = text.split(OPEN, 1)[0]
    return head, calls


def assistant_message(text: str) -> dict[str, Any]:
    """The turn as a chat message with structured tool_calls (what chat templates take), for
    re-rendering a conversation; a turn with a bad call keeps its raw text as content."""
    head, calls = parse_tool_calls(text)
    good = [c for c in calls if isinstance(c, ToolCall)]
    if not calls or len(good) < len(calls):   # none, or a BadCall among them
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": head.strip(),
            "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in good]}
