"""Building a config: from a preset, a YAML or JSON file (which may start from a ``base``), a run's
config.json, a dict or a Config, then ``--set section.key=value`` overrides. Values are converted to
the fields' types (nothing guessed), and every problem is one line naming its file or field."""

from __future__ import annotations

import json
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from moelab.config.hashing import config_hash, to_dict
from moelab.config.schema import SECTIONS, Config, validate
from moelab.errors import ConfigError
from moelab.presets import PRESETS, preset_dict


def _type_name(tp: Any) -> str:
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"a list, each item {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        inner = typing.get_args(tp)[1]
        return "a mapping of names to " + {float: "numbers", str: "strings"}.get(inner, "lists of strings")
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return str(tp)


_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Return (ok, value converted to tp). Ints widen to floats; nothing else is guessed."""
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str) and _NUMBER.match(value.strip()):  # YAML 1.1 reads 1e11 as a string
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    origin = typing.get_origin(tp)
    if origin is tuple:
        (inner, _) = typing.get_args(tp)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            return False, value
        out = []
        for v in value:
            ok, v2 = _coerce(v, inner)
            if not ok:
                return False, value
            out.append(v2)
        return True, tuple(out)
    if origin is dict:
        _, inner = typing.get_args(tp)
        if not isinstance(value, dict):
            return False, value
        conv = {}
        for k, v in value.items():
            ok, v2 = _coerce(v, inner)
            if not ok or not isinstance(k, str):
                return False, value
            conv[k] = v2
        return True, conv
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, v2 = _coerce(value, arg)
            if ok:
                return True, v2
        return False, value
    raise TypeError(f"unsupported config field type {tp}")


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def config_from_dict(data: dict, *, source: str = "config") -> Config:
    """Build and validate a Config from nested plain data; raise ConfigError listing every problem."""
    errors: list[str] = []
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: expected a mapping of sections, got {_describe(data)}"])
    sections: dict[str, Any] = {}
    for key in data:
        if key not in SECTIONS and key != "name":
            errors.append(f"{key}: unknown key in {source} (known: name, {', '.join(SECTIONS)})")
    for name, cls in SECTIONS.items():
        raw = data.get(name, {}) or {}
        if not isinstance(raw, dict):
            errors.append(f"{name}: expected a mapping, got {_describe(raw)}")
            continue
        hints = typing.get_type_hints(cls)
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in raw.items():
            if key not in known:
                errors.append(f"{name}.{key}: unknown key (known: {', '.join(sorted(known))})")
                continue
            ok, conv = _coerce(value, hints[key])
            if not ok:
                errors.append(f"{name}.{key}: expected {_type_name(hints[key])}, got {_describe(value)}")
                continue
            kwargs[key] = conv
        sections[name] = cls(**kwargs)
    cfg_name = data.get("name", "")
    if not isinstance(cfg_name, str):
        errors.append(f"name: expected a string, got {_describe(cfg_name)}")
        cfg_name = ""
    if errors:
        raise ConfigError(errors)
    cfg = Config(**sections, name=cfg_name)
    validate(cfg)
    return cfg


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError([f"--set {item}: expected section.key=value, for example model.d_model=256"])
    key, raw = item.split("=", 1)
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(
            [f"--set {key}: expected section.key, for example model.top_k (or deeper: data.text_field.web)"]
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if value is None:
        value = raw
    return path, value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for item in overrides:
        (section, *keys), value = parse_override(item)
        if section not in SECTIONS:
            raise ConfigError([f"{section}.{keys[0]}: unknown section {section!r} (known: {', '.join(SECTIONS)})"])
        node = data.setdefault(section, {})
        for depth, key in enumerate(keys[:-1]):  # a field that is a mapping, set one key deep (or deeper)
            inner = node.setdefault(key, {})
            if not isinstance(inner, dict):
                where = ".".join([section, *keys[: depth + 1]])
                raise ConfigError([f"--set {item.split('=', 1)[0]}: {where} is not a mapping; set it whole"])
            node = inner
        node[keys[-1]] = value
    return data


def load_config(spec: str | Path | dict | Config, overrides: Sequence[str] = ()) -> Config:
    """A preset name, a YAML or JSON file, a dict or a Config, then ``section.key=value`` overrides.

    A file may be what `moelab config` prints (its ``hash`` is checked against the fields) or a run's
    own config.json (``{"hash", "config"}``), and a YAML file may start from a preset or another file
    (``base: tiny``), its sections laid over the base's field by field, at any depth."""
    if isinstance(spec, Config):
        data, source = to_dict(spec), "config"
    elif isinstance(spec, dict):
        data, source = spec, "config"
    else:
        data, source = _read_spec(str(spec), ())
    data, expect = _unwrap(data)
    if expect is not None:  # the hash printed with the config: the fields must still be the ones it hashed
        got = config_hash(config_from_dict(data, source=source))
        if got != expect:
            raise ConfigError([f"{source}: hash {expect} is not its fields' ({got}): the config was edited after it "
                               "was printed; delete the hash line to keep the edit"])  # fmt: skip
    return config_from_dict(apply_overrides(data, overrides), source=source)


def _unwrap(data):
    """(the config's sections, the hash given with them or None): a run's config.json holds
    ``{"hash", "config"}``; `moelab config` prints the hash beside the sections."""
    if not isinstance(data, dict):
        return data, None
    if "config" in data and isinstance(data["config"], dict) and set(data) <= {"hash", "config"}:
        return data["config"], data.get("hash")
    if "hash" in data:
        rest = {k: v for k, v in data.items() if k != "hash"}
        return rest, data["hash"]
    return data, None


def _read_spec(spec: str, seen: tuple) -> tuple[dict, str]:
    """The plain data of a preset or a config file, its ``base`` (a preset or another file, relative
    to this one) resolved; ``seen``: the files above it, so a chain that loops is refused."""
    if spec in PRESETS:
        return preset_dict(spec), f"preset {spec}"
    if not (spec.endswith((".yaml", ".yml", ".json")) or Path(spec).exists()):
        raise ConfigError([f"{spec}: not a preset ({', '.join(PRESETS)}) and not a YAML file"])
    path = Path(spec)
    if path.is_dir():
        raise ConfigError([f"{spec}: is a directory; give a config file (YAML) or a preset"])
    if not path.is_file():
        raise ConfigError([f"{spec}: no such config file (or preset: {', '.join(PRESETS)})"])
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{spec}: not UTF-8 text (byte {exc.start}); save the config as UTF-8"]) from None
    except OSError as exc:
        raise ConfigError([f"{spec}: cannot read ({exc.strerror or exc})"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError([f"{spec}:{where} is not valid YAML; fix the syntax"]) from None
    if data is None:  # an empty file would train the schema's defaults, which no preset is
        raise ConfigError([f"{spec}: empty; a config names its base (base: tiny, say) and the fields it changes"])
    if not isinstance(data, dict):
        raise ConfigError([f"{spec}: expected a mapping of sections (base:, model:, train:, data:, mesh:), got a "
                           f"{type(data).__name__}"])  # fmt: skip
    if "base" not in data:
        return data, spec
    base = data["base"]
    if not isinstance(base, str) or not base.strip():
        raise ConfigError([f"{spec}: base: a preset name or a config file to start from, got {_describe(base)}"])
    here = str(path.resolve())
    if here in seen:
        raise ConfigError([f"{spec}: base: the chain of bases comes back to {path.name}; break the loop"])
    if base not in PRESETS and not Path(base).is_absolute():
        base = str(path.parent / base)
    below, _ = _read_spec(base, (*seen, here))
    below, _ = _unwrap(below)
    return _lay_over(below, {k: v for k, v in data.items() if k != "base"}), spec


def _lay_over(base: dict, top: dict) -> dict:
    """``top`` over ``base``: mappings merged key by key at every depth, anything else replaced."""
    out = json.loads(json.dumps(base))
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _lay_over(out[key], value)
        else:
            out[key] = value
    return out


def replace(cfg: Config, **sections: dict) -> Config:
    """A validated copy with some fields changed: ``replace(cfg, model={"top_k": 4})``."""
    data = to_dict(cfg)
    for name, changes in sections.items():
        if name == "name":
            data["name"] = changes
        else:
            data[name].update(changes)
    return config_from_dict(data)
