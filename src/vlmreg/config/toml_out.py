"""Write a config back as TOML, marking values that came from the family descriptor.

Only what run configs hold is supported: strings, numbers, booleans, arrays of those, inline tables (a
mapping such as ``[reward] functions``), and nested tables.
``None`` has no TOML spelling, so an unset value is written as a comment.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import attrs

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # TOML basic strings share JSON's escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):  # an inline table: [reward] functions = {exact = 1.0, ...}
        return "{" + ", ".join(f"{_key(str(k))} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def to_toml(config: Any, marks: Mapping[str, str] | None = None) -> str:
    """TOML text of an attrs config; ``marks`` maps dotted paths to a note written as a trailing comment."""
    marks = marks or {}
    out: list[str] = []

    def table(obj: Any, path: str) -> None:
        scalars: list[tuple[str, Any]] = []
        tables: list[tuple[str, Any]] = []
        for field in attrs.fields(type(obj)):
            value = getattr(obj, field.name)
            (tables if attrs.has(type(value)) else scalars).append((field.name, value))
        if path:
            out.append(f"\n[{path}]")
        for name, value in scalars:
            dotted = f"{path}.{name}" if path else name
            note = f"  # from {marks[dotted]}" if dotted in marks else ""
            if value is None:
                out.append(f"# {_key(name)} = (unset){note}")
            else:
                out.append(f"{_key(name)} = {_value(value)}{note}")
        for name, value in tables:
            table(value, f"{path}.{name}" if path else name)

    table(config, "")
    return "\n".join(out).lstrip("\n") + "\n"
