"""What each config field means, read from the fields themselves: the one source of
`moelab config --explain` and of the generated configuration reference (moelab.docgen)."""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from dataclasses import fields
from typing import Any

from moelab.config.schema import SECTIONS, Config
from moelab.errors import ConfigError


def type_label(tp: Any, plural: bool = False) -> str:
    """A field's type as a YAML or JSON writer sees it: integer, number, boolean, string, list of ..."""
    if tp in (int, float, bool, str):
        return {int: "integer", float: "number", bool: "boolean", str: "string"}[tp] + ("s" if plural else "")
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"list{'s' if plural else ''} of {type_label(typing.get_args(tp)[0], plural=True)}"
    if origin is dict:
        return f"mapping{'s' if plural else ''} of names to {type_label(typing.get_args(tp)[1], plural=True)}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_label(a, plural) for a in typing.get_args(tp))
    return str(tp)


def show_value(value: Any) -> str:
    """A field's value as it is written in a JSON (or YAML flow) config: "ntk", 128, [], true."""
    return json.dumps(value, default=list)


def field_paths() -> list[str]:
    """Every config field by its dotted name, in the order of the classes: model.d_model, ..., name."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in fields(cls)] + ["name"]


def summary(meaning: str) -> str:
    """A meaning's first sentence: the one line a section's listing shows."""
    head = re.split(r"(?<=[.?!])\s+", meaning.strip(), maxsplit=1)[0]
    return head if head.endswith((".", "?", "!")) else head + "."


def explain(path: str) -> dict:
    """What a config field means, from the field itself: ``{name, type, default, help}`` and ``choices``
    where the values are a fixed set. A section name (``model``) gives ``{name, help, fields}``, its
    fields each explained. An unknown name is a ConfigError of one line naming the nearest names."""
    path = path.strip()
    top = {f.name: f for f in fields(Config)}
    if path in SECTIONS:
        return {
            "name": path,
            "help": top[path].metadata["help"],
            "fields": [explain(f"{path}.{f.name}") for f in fields(SECTIONS[path])],
        }
    section, _, key = path.rpartition(".")
    cls = SECTIONS.get(section) if section else Config
    found = {f.name: f for f in fields(cls)}.get(key) if cls is not None else None
    if found is None or (cls is Config and key in SECTIONS):
        raise ConfigError([_unknown_field(path)])
    tp = typing.get_type_hints(cls)[key]
    out = {"name": path, "type": type_label(tp), "default": found.default, "help": found.metadata.get("help", "")}
    if "choices" in found.metadata:
        out["choices"] = found.metadata["choices"]
    return out


def _unknown_field(path: str) -> str:
    names = field_paths()
    near = difflib.get_close_matches(path, names + list(SECTIONS), n=3, cutoff=0.75)
    last = path.rpartition(".")[2]  # top_k, or a misspelt key in the wrong section: its full names
    by_key: dict[str, list[str]] = {}
    for n in names:
        by_key.setdefault(n.rpartition(".")[2], []).append(n)
    for key in difflib.get_close_matches(last, list(by_key), n=3, cutoff=0.75):
        near += by_key[key]
    near = list(dict.fromkeys(near))[:4]
    section = path.partition(".")[0]
    if near:
        hint = f"did you mean {', '.join(near)}?"
    elif section in SECTIONS:
        hint = f"`moelab config --explain {section}` lists its fields"
    else:
        hint = f"the sections are {', '.join(SECTIONS)} (and the top-level name)"
    return f"{path}: no such config field; {hint}"
