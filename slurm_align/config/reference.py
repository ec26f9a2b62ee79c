"""The configuration reference, generated from the typed config (RunConfig, ClusterProfile): every
field with its type, allowed values, bounds, default and docstring. One source for the docs'
reference pages (docs/hooks/reference.py renders them at build time, so they cannot drift from
the code) and for `slurm-align config explain FIELD`.

A model class used at several places (ModelConfig for `model` and `critic_model`, ParallelConfig
for `actor`, `critic`, `generator`) gets one section, named by its first path; the others point
to it. A dict of models (the profile's `components`) is a section under `components.NAME`.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class FieldDoc:
    path: str
    """Dotted path as written in a config or an override, e.g. 'rollout.mode'."""
    name: str
    type: str
    """Type as a user writes it: allowed values of a Literal, `int | None`, a section's name."""
    default: str
    """The default as YAML/JSON text, 'required', or a note (a section's own defaults)."""
    bounds: str
    """Numeric bounds, lengths and patterns ('>= 1, < 1'), '' without any."""
    doc: str


@dataclass(frozen=True)
class SectionDoc:
    path: str
    """Dotted path of the section ('' for the top level)."""
    model: type[BaseModel]
    doc: str
    fields: tuple[FieldDoc, ...]
    also: tuple[str, ...] = ()
    """Other paths with the same fields (the same model class used again)."""


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic model classes a field's annotation holds (itself, in a union, list or dict)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _is_dict(annotation: Any) -> bool:
    return typing.get_origin(annotation) is dict


def type_text(annotation: Any) -> str:
    """A field's type as a config author reads it."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin in (list, tuple, set):
        return f"list[{', '.join(type_text(a) for a in args if a is not Ellipsis)}]"
    if origin is dict:
        return f"dict[{type_text(args[0])}, {type_text(args[1])}]"
    if annotation is type(None):
        return "null"
    if annotation is typing.Any:
        return "any"
    if isinstance(annotation, type):
        if issubclass(annotation, Path):
            return "path"
        return annotation.__name__
    return str(annotation)


def _value_text(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "(its fields' defaults)"
    if isinstance(value, Path):
        return json.dumps(str(value))
    return json.dumps(value, default=str)


def default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        try:
            value = info.default_factory()  # type: ignore[call-arg]  # the no-argument form; see except
        except TypeError:   # a factory of the validated data (pydantic >= 2.10): no static default
            return "(computed)"
        return _value_text(value)
    if info.default is PydanticUndefined:
        return "required"
    return _value_text(info.default)


_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="), (annotated_types.Lt, "lt", "<"),
           (annotated_types.Le, "le", "<="), (annotated_types.MinLen, "min_length", "length >="),
           (annotated_types.MaxLen, "max_length", "length <="))


def bounds_text(info: FieldInfo) -> str:
    out = []
    for item in info.metadata:
        for cls, attr, sign in _BOUNDS:
            if isinstance(item, cls):
                out.append(f"{sign} {getattr(item, attr)}")
        pattern = getattr(item, "pattern", None)
        if isinstance(pattern, str):
            out.append(f"matches {pattern}")
    return ", ".join(out)


def doc_text(text: str | None) -> str:
    """A docstring as one paragraph (they are wrapped prose)."""
    return " ".join(inspect.cleandoc(text or "").split())


def sections(model: type[BaseModel], path: str = "") -> list[SectionDoc]:
    """Every section reachable from `model`, depth first, each model class once."""
    first: dict[type[BaseModel], int] = {}
    out: list[SectionDoc] = []
    extra_paths: dict[int, list[str]] = {}

    def visit(cls: type[BaseModel], at: str) -> None:
        if cls in first:
            extra_paths[first[cls]].append(at)
            return
        first[cls] = len(out)
        extra_paths[len(out)] = []
        fields = []
        nested: list[tuple[type[BaseModel], str]] = []
        for name, info in cls.model_fields.items():
            fpath = f"{at}.{name}" if at else name
            models = _models_in(info.annotation)
            fields.append(FieldDoc(path=fpath, name=name, type=type_text(info.annotation), default=default_text(info),
                                   bounds=bounds_text(info), doc=doc_text(info.description)))
            for m in models:
                nested.append((m, f"{fpath}.NAME" if _is_dict(info.annotation) else fpath))
        out.append(SectionDoc(path=at, model=cls, doc=doc_text(cls.__doc__) if cls.__doc__ else "",
                              fields=tuple(fields)))
        for m, mpath in nested:
            visit(m, mpath)

    visit(model, path)
    return [SectionDoc(s.path, s.model, s.doc, s.fields, tuple(extra_paths[i])) for i, s in enumerate(out)]


def _anchor(path: str) -> str:
    return "top" if not path else re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def _md(text: str) -> str:
    """Escape what Markdown would read as HTML or emphasis, outside `code spans`."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace("*", r"\*").replace("_", r"\_")
    return "`".join(parts)


def markdown(model: type[BaseModel], title: str) -> str:
    """The reference page of `model`: a section per model class, a definition entry per field."""
    secs = sections(model)
    section_of = {s.model: s for s in secs}
    lines = [f"# {title}", "", "Generated from the typed config at build time "
             f"(`{model.__module__}.{model.__qualname__}`): it always matches the code. Any field can be set in "
             "the YAML file or overridden on the command line as `path.to.field=value`.", ""]
    anchors = [_anchor(s.path) for s in secs]
    anchors += [_anchor(f.path) for s in secs for f in s.fields
                if not _models_in(model_field(s.model, f.name).annotation)]
    if len(set(anchors)) != len(anchors):   # a link would land on the wrong entry
        raise ValueError(f"two entries share an anchor: {sorted(a for a in anchors if anchors.count(a) > 1)}")
    for s in secs:
        heading = f"`{s.path}`" if s.path else "Top level"
        lines += [f"## {heading} {{ #{_anchor(s.path)} }}", "", f"`{s.model.__name__}`. {_md(s.doc)}".rstrip(), ""]
        if s.also:
            lines += ["The same fields serve " + ", ".join(f"`{p}`" for p in s.also) + ".", ""]
        for f in s.fields:
            kind = f.type
            for m in _models_in(model_field(s.model, f.name).annotation):
                kind = kind.replace(m.__name__, f"[{m.__name__}](#{_anchor(section_of[m].path)})")
            facts = [kind if "](" in kind else f"`{kind}`", f"default `{f.default}`"]
            if f.bounds:
                facts.append(f"`{f.bounds}`")
            # a section's field links to the section; the others carry the anchor of their path
            term = f"`{f.path}`" if "](" in kind else f"`{f.path}` {{ #{_anchor(f.path)} }}"
            lines += [term, f":   {' · '.join(facts)}", "", f"    {_md(f.doc)}", ""]
    return "\n".join(lines)


def model_field(cls: type[BaseModel], name: str) -> FieldInfo:
    return cls.model_fields[name]


def explain(model: type[BaseModel], dotted: str) -> FieldDoc:
    """One field's entry by its dotted path, as an override writes it (a dict's key included:
    `components.actor.nodes`); KeyError naming what the path's last section has otherwise."""
    cls, parts, i = model, dotted.split("."), 0
    done: list[str] = []
    while True:
        part = parts[i]
        if part not in cls.model_fields:
            raise KeyError(f"{'.'.join([*done, part])!r} is not a field; "
                           f"{'.'.join(done) or 'the top level'} has: {', '.join(cls.model_fields)}")
        info = cls.model_fields[part]
        done.append(part)
        if i == len(parts) - 1:
            return FieldDoc(path=dotted, name=part, type=type_text(info.annotation), default=default_text(info),
                            bounds=bounds_text(info), doc=doc_text(info.description))
        models = _models_in(info.annotation)
        if not models:
            raise KeyError(f"{'.'.join(done)!r} is {type_text(info.annotation)}, not a section with fields")
        cls, i = models[0], i + 1
        if _is_dict(info.annotation):   # a key such as components.actor, then the model's fields
            done.append(parts[i])
            i += 1
            if i == len(parts):
                raise KeyError(f"{dotted!r}: give a field of it, one of: {', '.join(cls.model_fields)}")
