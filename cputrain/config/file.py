"""A config from a YAML file and dotted `key=value` overrides, validated before any work: an
unknown key names the nearest valid one, a bad value names its key, and `--help-config` lists
every key with its default and documentation."""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from cputrain.config.sections import Config
from cputrain.errors import ConfigError


def _all_keys(model_cls: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model_cls.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_all_keys(ann, dotted + "."))
    return keys


def _nearest_key(key: str) -> str | None:
    keys = _all_keys(Config)
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not match:  # a right name under the wrong section: "train.seq_len" -> "data.seq_len"
        leaf = key.rsplit(".", 1)[-1]
        match = [k for k in keys if k.rsplit(".", 1)[-1] == leaf] or difflib.get_close_matches(
            leaf, keys, n=1, cutoff=0.75
        )
    return match[0] if match else None


# How pydantic names the members of a union type in an error's location (`bool | Literal["auto"]`
# fails as 'model.compile.bool' and "model.compile.literal['auto']"), and how a user writes them.
_UNION_MEMBERS = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "a string",
                  "list[str]": "a list of names"}


def pattern_words(pattern: str) -> str:
    """A string pattern as a user writes the value: ^[0-9]+\\+selective$ → N+selective."""
    return pattern.strip("^$").replace("[0-9]+", "N").replace("\\", "")


def _union_error(errors: list[dict]) -> str | None:
    """One line for a value that fits no member of a union: the key without the member's name, and
    what it may be; a member's own check (a number out of range) is said as it is."""
    first = errors[0]
    if not first["loc"]:  # a check across keys (the batch sizes): no key to name
        return None
    key_loc, member = first["loc"][:-1], str(first["loc"][-1])
    same = [e for e in errors if e["loc"][:-1] == key_loc]
    if not key_loc or len(same) < 2 or not (member in _UNION_MEMBERS or member.startswith("literal[")):
        return None
    key = ".".join(str(p) for p in key_loc)
    own = next((e for e in same if e["type"] == "value_error"), None)
    if own is not None:
        return f"bad value for '{key}' ({first.get('input')!r}): {own['msg'].removeprefix('Value error, ')}"
    allowed = []
    for e in same:
        tag = str(e["loc"][-1])
        if tag == "constrained-str" and "pattern" in e.get("ctx", {}):  # a pattern such as ^[0-9]+\+selective$
            allowed.append(pattern_words(e["ctx"]["pattern"]))
            continue
        allowed.append(tag.removeprefix("literal[").removesuffix("]").replace("'", "").replace(",", " or ") if tag.startswith("literal[")
                       else _UNION_MEMBERS.get(tag, tag))
    return f"bad value for '{key}' ({first.get('input')!r}): use {', or '.join(allowed)}"


def _first_error(err: ValidationError) -> str:
    union = _union_error(err.errors())
    if union:
        return union
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"])
    if e["type"] == "extra_forbidden":
        hint = _nearest_key(key)
        return f"unknown config key '{key}'" + (f"; did you mean '{hint}'?" if hint else "")
    if not key:
        return e["msg"].removeprefix("Value error, ")
    return f"bad value for '{key}' ({e.get('input')!r}): {e['msg'].removeprefix('Value error, ')}"


def _parse_value(text: str) -> Any:
    # YAML scalars: "20" -> 20, "3e-4" -> 0.0003, "true" -> True, "null" -> None, "[1,2]" -> list
    value = yaml.safe_load(text) if text != "" else ""
    if isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" as a string; people mean a number
            return float(value) if any(c in value for c in "eE") and value[0] in "0123456789.-" else value
        except ValueError:
            return value
    return value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value; write it like train.max_steps=20")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = raw
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{key}': '{part}' is a value, not a section")
            node = child
        value = _parse_value(text)
        if value is None and not _admits_none(parts):
            node.pop(parts[-1], None)  # key=null on a key that takes no null: unset, back to its default
        else:
            node[parts[-1]] = value
    return raw


def _admits_none(parts: list[str]) -> bool:
    """Whether the config key at `parts` takes null (an optional key); an unknown key: it is kept as
    given, so validation names it."""
    model: type[BaseModel] = Config
    for part in parts[:-1]:
        field = model.model_fields.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return True
        model = field.annotation
    field = model.model_fields.get(parts[-1])
    return field is None or type(None) in typing.get_args(field.annotation)


def named_file_text(path: str | Path, missing: str) -> str:
    """The text of a file the user named; `missing` is the one-line error when it is no file."""
    if not Path(path).is_file():
        raise ConfigError(missing)
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = err.object[: err.start].count(b"\n") + 1
        raise ConfigError(f"'{path}' line {line} is not UTF-8 text (byte {err.object[err.start]:#04x}); save the "
                          "file as UTF-8") from None


def read_yaml(path: str | Path) -> dict:
    text = named_file_text(path, f"config file '{path}' not found; pass an existing YAML file or none for the default run")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"malformed YAML in '{path}'{where}: {problem}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"'{path}' must hold a mapping of sections (model:, data:, train: …), not {type(raw).__name__}")
    return raw


def validate(raw: dict) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_first_error(err)) from None


def config_and_overrides(first: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """A command's first positional is its config file, unless it is a key=value that names no
    file (`cputrain train train.max_steps=5`: no file, only overrides). Every command reads it so."""
    overrides = list(overrides)
    if first and "=" in first and not Path(first).exists():
        return None, [first, *overrides]
    return first, overrides


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    raw = read_yaml(path) if path else {}
    return validate(apply_overrides(raw, list(overrides or [])))


def config_fields(model_cls: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, FieldInfo]]:
    """(dotted key, pydantic field) for every leaf field, in the order the sections declare them:
    the one walk behind --help-config and the configuration reference (`config.reference`)."""
    rows = []
    for name, field in model_cls.model_fields.items():
        ann = field.annotation
        dotted = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(config_fields(ann, dotted + "."))
        else:
            rows.append((dotted, field))
    return rows


def field_default(field: FieldInfo) -> Any:
    return field.get_default(call_default_factory=True)


def field_doc(field: FieldInfo) -> str:
    """The docstring under a field, on one line."""
    return " ".join((field.description or "").split())


def describe_fields(model_cls: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every leaf field: the reference printed by --help-config."""
    return [(dotted, repr(field_default(field)), field_doc(field)) for dotted, field in config_fields(model_cls, prefix)]
