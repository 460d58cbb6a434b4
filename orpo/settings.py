"""Typed stage settings: a frozen dataclass per config section, built once from the schema-validated mapping.

The schema (orpo/config.schema.yaml) stays the one place of defaults, types and ranges: `build` checks a
mapping against the section, fills the schema's defaults and makes the dataclass, nested sections included.
A dataclass has no defaults of its own, and its fields are the section's keys (a field named after a Python
keyword carries a trailing underscore: `lambda_` is the key `lambda`), so code reads `s.batch_size`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from orpo.config import ConfigError, _check, _coerce, _fill_defaults, load_schema

T = TypeVar("T")


def key_of(field: dataclasses.Field) -> str:
    """The config key a field holds (`lambda_` -> `lambda`)."""
    return field.name[:-1] if field.name.endswith("_") else field.name


def schema_node(section: str) -> dict[str, Any]:
    """The schema of a dotted config section ("train", "train.engine")."""
    node = load_schema()
    for part in section.split("."):
        node = node["properties"][part]
    return node


def build(cls: type[T], section: str, mapping: Mapping[str, Any] | None, drop: tuple[str, ...] = (),
          what: str = "settings") -> T:
    """`cls` from `mapping`: checked against the schema's `section` (less the keys in `drop`), the schema's
    defaults filled in; a bad key or value raises ConfigError naming `what` and the dotted key."""
    sub = copy.deepcopy(schema_node(section))
    for key in drop:
        sub.get("properties", {}).pop(key, None)
    value = copy.deepcopy(dict(mapping or {}))
    _coerce(value, sub)
    _fill_defaults(value, sub)
    instance, schema = value, sub
    for part in reversed(section.split(".")):  # errors name the dotted key from the top of the config
        instance, schema = {part: instance}, {"type": "object", "properties": {part: schema}}
    _check(instance, schema, what)
    return from_mapping(cls, value, section)


def typed(cls: type[T], section: str, settings: T | Mapping[str, Any] | None, drop: tuple[str, ...] = ()) -> T:
    """A stage core's settings as `cls`: given typed (the command line built them), as they are; given as a
    mapping (a caller in Python), built as the command line builds them (`build`)."""
    return settings if isinstance(settings, cls) else build(cls, section, settings, drop)


def from_mapping(cls: type[T], mapping: Mapping[str, Any], where: str = "settings") -> T:
    """`cls` from a complete mapping of its keys (a recorded, already validated one): no defaults, no extra keys."""
    fields = dataclasses.fields(cls)
    keys = {key_of(f) for f in fields}
    missing, unknown = sorted(keys - set(mapping)), sorted(set(mapping) - keys)
    if missing or unknown:
        raise ConfigError(f"{where}: " + "; ".join(filter(None, [missing and f"missing {', '.join(missing)}",
                                                                 unknown and f"unknown {', '.join(unknown)}"])))
    hints = _hints(cls)
    return cls(**{f.name: _value(hints[f.name], mapping[key_of(f)], f"{where}.{key_of(f)}") for f in fields})


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _value(hint: Any, value: Any, where: str) -> Any:
    """A mapping's value as the field's type reads it: nested sections as their dataclass, lists as tuples,
    an integer where a float is meant as a float; anything else (unions, literals) as it is."""
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, where)
    origin = typing.get_origin(hint)
    if origin is tuple and isinstance(value, (list, tuple)):
        return tuple(value)
    numbers = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    if float in numbers and int not in numbers and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def as_dict(settings: Any) -> dict[str, Any]:
    """The settings as a JSON-ready mapping of config keys (nested sections as mappings, tuples as lists)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        out[key_of(f)] = _plain(getattr(settings, f.name))
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return as_dict(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def field_keys(cls: type) -> dict[str, Any]:
    """The keys a settings class holds, nested sections as mappings: what a test compares with the schema's."""
    hints = _hints(cls)
    return {key_of(f): field_keys(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else None
            for f in dataclasses.fields(cls)}


def schema_keys(section: str, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keys of the schema's `section`, object sections with properties as mappings (as `field_keys`)."""
    def keys(node: dict[str, Any]) -> dict[str, Any]:
        return {k: keys(v) if v.get("type") == "object" and "properties" in v else None
                for k, v in node.get("properties", {}).items()}

    return {k: v for k, v in keys(schema_node(section)).items() if k not in drop}
