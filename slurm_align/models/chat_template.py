"""Chat templates (tokenizer_config.json's `chat_template`, or chat_template.jinja) rendered
exactly as transformers' `apply_chat_template` renders them.

The environment is transformers' (utils/chat_template_utils.py): an immutable Jinja2 sandbox
with trim_blocks and lstrip_blocks, the loopcontrols extension, `raise_exception`,
`strftime_now`, a `tojson` filter that does not HTML-escape, and `dict`/`namespace` that refuse
private names; the template sees `messages`, `tools`, `documents`, `add_generation_prompt` and
the tokenizer's named special tokens (bos_token, eos_token, ...) as strings; `tools` is the list
of tool schemas given (Tool.schema() of slurm_align.environments.tools) or None. Keys whose value is
None are dropped from each message and a message's reasoning is aliased under
`reasoning_content` and `thinking`, as transformers does. transformers itself is not needed.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers' names for a message's reasoning; the first is the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}  # noqa: RUF012  (jinja2's Extension API: a class-level set of tag names)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` without attribute access to the real type (sandbox escape guard)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A Jinja namespace that refuses underscore-prefixed attributes (CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached: a dataset renders thousands of rows with one template).
    Raises jinja2.TemplateSyntaxError on a malformed template."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _normalise(message: dict[str, Any]) -> dict[str, Any]:
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _tool_schemas(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as the template sees them: JSON schemas (dicts, e.g. Tool.schema()), passed as they
    are, as transformers passes dict tools (it also converts Python functions; we take schemas only)."""
    if tools is None:
        return None
    for tool in tools:
        if not isinstance(tool, dict):
            raise TypeError(f"a tool for the chat template must be a JSON schema dict, got {type(tool).__name__}")
    return json.loads(json.dumps(tools))   # a plain-JSON copy: templates never see the caller's objects


def render_chat(source: str, messages: list[dict[str, Any]], special_tokens: dict[str, str], *,
                add_generation_prompt: bool = False, tools: list[dict[str, Any]] | None = None) -> str:
    """The conversation as text, as `tokenizer.apply_chat_template(messages, tools=tools,
    tokenize=False, add_generation_prompt=...)` gives it. Messages may hold tool calls
    (assistant `tool_calls`: [{"type": "function", "function": {"name", "arguments"}}]) and tool
    turns (role "tool"), which the template renders its own way. Raises jinja2.TemplateError
    when the template does (e.g. its own `raise_exception` on roles it does not allow)."""
    return compile_template(source).render(
        messages=[_normalise(m) for m in messages], tools=_tool_schemas(tools), documents=None,
        add_generation_prompt=add_generation_prompt, **special_tokens)
