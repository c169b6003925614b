"""The attrs validators of the SDK's value objects (`FamilyDescriptor` and its parts, `Task`, `Reward`, `Engine`,
`EnvironmentSpec`, `Objective`, `MetricsSink`, `Transport`): each checks one field when the object is built and
raises `DescriptorError` naming the object (its kind and ``name``), the field and the value at fault. Nothing here
imports torch or transformers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from vlmreg.sdk.errors import DescriptorError

__all__ = [
    "IMPORT_RE",
    "NAME_RE",
    "PATH_RE",
    "SUFFIX_RE",
    "check_bool",
    "check_callable",
    "check_int",
    "check_mapping",
    "check_name",
    "check_optional_pair",
    "check_optional_path",
    "check_optional_str",
    "check_path",
    "check_strings",
    "check_type",
    "check_weight_mapping",
    "field_error",
    "freeze",
    "owner_name",
]

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
PATH_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")
SUFFIX_RE = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
IMPORT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def owner_name(instance: Any) -> str:
    name = getattr(instance, "name", None)
    kind = type(instance).__name__
    return f"{kind} {name!r}" if isinstance(name, str) else kind


def field_error(instance: Any, attribute: attrs.Attribute, message: str, value: Any) -> DescriptorError:
    return DescriptorError(f"{owner_name(instance)}: field {attribute.name!r} {message} (got {value!r})")


def check_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise field_error(instance, attribute, "must be a lower-case name of letters, digits, '_', '.' or '-'", value)


def check_path(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not PATH_RE.match(value):
        raise field_error(instance, attribute, "must be a dotted attribute path such as 'model.language_model'", value)


def check_optional_path(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        check_path(instance, attribute, value)


def check_strings(pattern: re.Pattern[str] | None, what: str, *, non_empty: bool = False, unique: bool = True):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise field_error(instance, attribute, f"must be a list of {what}", value)
        if non_empty and not value:
            raise field_error(instance, attribute, f"must list at least one {what.rstrip('s')}", value)
        for item in value:
            if not isinstance(item, str) or (pattern is not None and not pattern.match(item)):
                raise field_error(instance, attribute, f"must be a list of {what}; {item!r} is not one", value)
        if unique and len(set(value)) != len(value):
            dupes = sorted({v for v in value if list(value).count(v) > 1})
            raise field_error(instance, attribute, f"lists {', '.join(map(repr, dupes))} more than once", value)

    return check


def check_mapping(key_check: Callable[[Any], bool], value_type: type | tuple[type, ...], what: str):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, Mapping):
            raise field_error(instance, attribute, f"must be a mapping of {what}", value)
        for key, item in value.items():
            if not key_check(key) or not isinstance(item, value_type):
                raise field_error(instance, attribute, f"must be a mapping of {what}; this entry is not", {key: item})

    return check


def check_int(minimum: int, *, optional: bool = False):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            kind = "an int" if not optional else "None or an int"
            raise field_error(instance, attribute, f"must be {kind} >= {minimum}", value)

    return check


def check_type(kind: type | tuple[type, ...], what: str, *, optional: bool = False):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not (optional and value is None) and not isinstance(value, kind):
            raise field_error(instance, attribute, f"must be {'None or ' if optional else ''}{what}", value)

    return check


def check_bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise field_error(instance, attribute, "must be True or False", value)


def check_optional_str(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise field_error(instance, attribute, "must be None or a non-empty string", value)


def check_optional_pair(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (
        isinstance(value, str)
        or not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, str) for v in value)
        or not any(value)
    ):
        raise field_error(
            instance, attribute, "must be None or a pair of strings (before, after), not both empty", value
        )


def check_callable(optional: bool, what: str = "a zero-argument callable"):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if optional and value is None:
            return
        if not callable(value):
            hint = what + (" or None" if optional else "")
            raise field_error(instance, attribute, f"must be {hint} (pass the function, do not call it)", value)

    return check


def check_weight_mapping(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not callable(value):
        raise field_error(
            instance,
            attribute,
            "must be a callable mapping an iterable of (name, tensor) pairs to (name, tensor) pairs",
            value,
        )


def freeze(instance: Any, **fields: Any) -> None:
    """Store normalised (immutable) values on a frozen instance after validation."""
    for name, value in fields.items():
        object.__setattr__(instance, name, value)
