"""TOML -> `RunConfig`, strictly, with every problem reported at once under its dotted TOML path.

cattrs does the structuring (``forbid_extra_keys``, detailed validation); the hooks here make it strict
(no ``"16"`` -> 16, no 16.7 -> 16, no 1 -> ``"1"``) and the walker turns cattrs' exception tree into
lines such as ``model.lora.r: must be > 0 (got 0)``.
"""

from __future__ import annotations

import copy
import re
import tomllib
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError
from cattrs.gen import make_dict_structure_fn

from vlmreg.config.checks import FieldProblem, SectionInvalid
from vlmreg.config.schema import RunConfig
from vlmreg.sdk.errors import VlmregError, did_you_mean

__all__ = [
    "ConfigError",
    "ParsedDocument",
    "apply_sets",
    "blame_sets",
    "load_config",
    "load_document",
    "parse_config",
    "parse_document",
]


class ConfigError(VlmregError, ValueError):
    """A config file (or ``--set`` override) with one or more problems; ``problems`` holds one line each."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source, self.problems = source, list(problems)
        count = f"{len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"
        super().__init__(f"{source}: {count}\n" + "\n".join(f"  {p}" for p in self.problems))


_KIND = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _describe(value: Any) -> str:
    kinds = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "a table",
    }
    return kinds.get(type(value), type(value).__name__)


class _TypeMismatch(TypeError):
    def __init__(self, expected: str, value: Any) -> None:
        super().__init__(f"expected {expected} (got {value!r}, {_describe(value)})")


def _strict(kind: type):
    def hook(value: Any, _: Any) -> Any:
        ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise _TypeMismatch(_KIND[kind], value)
        return value

    return hook


def _literal_hook(tp: Any):
    allowed = typing.get_args(tp)

    def hook(value: Any, _: Any) -> Any:
        if value not in allowed or type(value) is not type(allowed[0]):
            hint = did_you_mean(value, [str(a) for a in allowed]) if isinstance(value, str) else ""
            raise ValueError(f"must be one of {', '.join(repr(a) for a in allowed)} (got {value!r}).{hint}".rstrip("."))
        return value

    return hook


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    for kind in (int, float, str, bool):
        converter.register_structure_hook(kind, _strict(kind))
    converter.register_structure_hook_factory(lambda t: typing.get_origin(t) is Literal, _literal_hook)

    def list_of_str(value: Any, _: Any) -> list[str]:
        if not isinstance(value, list):
            raise _TypeMismatch("an array of strings", value)
        for index, item in enumerate(value):
            if not isinstance(item, str):
                raise TypeError(f"expected an array of strings; item [{index}] is {item!r}, {_describe(item)}")
        return list(value)

    converter.register_structure_hook_func(lambda t: t == list[str], list_of_str)

    def str_or_list(value: Any, _: Any) -> str | list[str]:
        if isinstance(value, str):
            return value
        return list_of_str(value, None)

    converter.register_structure_hook_func(
        lambda t: t == (str | list[str] | None), lambda v, t: None if v is None else str_or_list(v, t)
    )

    def weights(value: Any, _: Any) -> dict[str, float]:
        if not isinstance(value, Mapping):
            raise _TypeMismatch("a table of names to weights", value)
        out = {}
        for key, weight in value.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise TypeError(f"expected a number for {key!r} (got {weight!r}, {_describe(weight)})")
            out[key] = float(weight)
        return out

    converter.register_structure_hook_func(
        lambda t: t == (dict[str, float] | None), lambda v, t: None if v is None else weights(v, t)
    )

    def table_factory(cl: type) -> Callable[[Any, Any], Any]:
        inner: Callable[[Any, Any], Any] = make_dict_structure_fn(
            cl, converter, _cattrs_forbid_extra_keys=True, _cattrs_detailed_validation=True
        )

        def hook(value: Any, _: Any) -> Any:
            if not isinstance(value, Mapping):
                raise _TypeMismatch("a table", value)
            return inner(value, cl)

        return hook

    converter.register_structure_hook_factory(attrs.has, table_factory)
    return converter


_CONVERTER = _make_converter()


def _path_of(exc: BaseException) -> list[str]:
    parts: list[str] = []
    for note in getattr(exc, "__notes__", ()):
        name = getattr(note, "name", None)
        index = getattr(note, "index", None)
        if name is not None:
            parts.append(str(name))
        elif index is not None:
            parts.append(f"[{index}]")
    return parts


def _join(parts: Iterable[str]) -> str:
    out = ""
    for part in parts:
        out += part if part.startswith("[") or not out else f".{part}"
    return out or "(top level)"


def _lookup(raw: Any, parts: Sequence[str]) -> Any:
    for part in parts:
        if part.startswith("[") and isinstance(raw, list):
            raw = raw[int(part[1:-1])]
        elif isinstance(raw, Mapping) and part in raw:
            raw = raw[part]
        else:
            return None
    return raw


def _problems(exc: BaseException, path: list[str], raw: Any, removable: list[list[str]]) -> list[str]:
    """Flatten cattrs' exception tree into lines; record paths whose removal lets the rest be checked."""
    path = path + _path_of(exc)
    if isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl)]
        removable.extend([*path, key] for key in exc.extra_fields)
        return [
            f"{_join([*path, key])}: unknown key.{did_you_mean(key, known)} Keys here: {', '.join(known)}"
            for key in sorted(exc.extra_fields)
        ]
    if isinstance(exc, FieldProblem):
        where = _join([*path, exc.field])
        value = exc.value
        return [f"{where}: {exc.message}" + (f" (got {value!r})" if value is not None else "")]
    if isinstance(exc, BaseExceptionGroup):
        return [line for sub in exc.exceptions for line in _problems(sub, path, raw, removable)]
    if isinstance(exc, KeyError):
        return [f"{_join(path)}: required key missing"]
    removable.append(path)
    if isinstance(exc, (TypeError, ValueError)) and not isinstance(exc, SectionInvalid):
        return [f"{_join(path)}: {exc}"]
    return [f"{_join(path)}: {type(exc).__name__}: {exc} (got {_lookup(raw, path)!r})"]


def _without(data: Any, path: Sequence[str]) -> bool:
    """Remove ``path`` from a document; whether it was there."""
    for part in path[:-1]:
        if not isinstance(data, Mapping) or part not in data:
            return False
        data = data[part]
    if isinstance(data, dict) and path and not path[-1].startswith("[") and path[-1] in data:
        del data[path[-1]]
        return True
    return False


@attrs.frozen
class ParsedDocument:
    """What `parse_document` makes of a TOML document: every problem found, and the config it still gives.

    ``config``: the document with every bad entry dropped (defaults in their place), or ``None`` when even that does
    not structure; ``dropped``: the dotted paths of those entries; ``model_stand_in``: ``[model]`` itself could not be
    built and ``config.model`` is a stand-in, so only checks that do not read ``[model]`` may use ``config``.
    """

    config: RunConfig | None
    problems: list[str]
    dropped: list[str]
    model_stand_in: bool = False

    def depends_on_dropped(self, problem: str) -> bool:
        """Whether a problem found on ``config`` reads a dropped entry (it names that key, or would judge its
        default)."""
        _, _, message = problem.partition(": ")
        return any(re.search(rf"\b{re.escape(path.rsplit('.', 1)[-1])}\b", message) for path in self.dropped)


_STAND_IN_MODEL = {"init": "random", "family": "(stand-in)"}


def _location(problem: str) -> list[str]:
    """The dotted path a problem line starts with, as keys (an array index dropped: the whole array is meant)."""
    return problem.split(":", 1)[0].split("[", 1)[0].split(".")


def _inside_dropped(problem: str, dropped: Sequence[str]) -> bool:
    location = ".".join(_location(problem))
    return any(location == d or location.startswith(f"{d}.") for d in dropped)


def _table_of(problem: str) -> str:
    return ".".join(_location(problem)[:-1])


def parse_document(data: Mapping[str, Any], source: str = "<config>") -> ParsedDocument:
    """Structure a TOML document into a `RunConfig`, collecting every problem rather than stopping at the first.

    A section with an unknown key or a mistyped value is never constructed, which would hide the value checks of its
    other fields; so such entries are dropped and the document is checked again, until nothing new turns up. Then
    the entries with bad values are dropped too, so that the checks across sections (and, in `vlmreg validate`, the
    registry and family checks) still run on the rest: a problem found then is kept only when it neither lies in a
    table that already had one nor names a dropped key (it would judge a default, not what was written).
    """

    document = copy.deepcopy(dict(data))
    problems: list[str] = []
    dropped: list[str] = []
    settling = stand_in = False
    for _ in range(16):
        try:
            config = _CONVERTER.structure(document, RunConfig)
        except Exception as exc:  # cattrs reports a tree of exceptions; flatten it into lines
            removable: list[list[str]] = []
            found = _problems(exc, [], data, removable)
            kept = found
            if dropped:  # a problem of what is left, unless it names a dropped entry or lies where one was
                parsed = ParsedDocument(None, problems, dropped)
                kept = [p for p in found if not parsed.depends_on_dropped(p) and not _inside_dropped(p, dropped)]
            if settling:  # a table's cross checks would read the defaults of its dropped entries
                bad_tables = {_table_of(p) for p in problems} | {d.rsplit(".", 1)[0] for d in dropped}
                kept = [p for p in kept if _table_of(p) not in bad_tables]
            problems.extend(p for p in kept if p not in problems)
            problems.sort(key=lambda line: line.split(":", 1)[0])
            removable = [r for r in removable if r and not r[-1].startswith("[")]
            if not removable:  # only bad values are left: drop them too, to check what does not depend on them
                settling = True
                removable = [_location(p) for p in found]
            changed = False
            for path in removable:
                if _without(document, path):
                    changed = True
                    dropped.append(".".join(path))
            if not changed:
                if not stand_in and isinstance(document, dict) and any(_location(p)[0] == "model" for p in found):
                    document["model"], stand_in, settling = dict(_STAND_IN_MODEL), True, True
                    continue
                return ParsedDocument(None, problems, dropped)
        else:
            return ParsedDocument(config, problems, sorted(set(dropped)), stand_in)
    return ParsedDocument(None, problems, dropped)


def parse_config(data: Mapping[str, Any], source: str = "<config>") -> RunConfig:
    """Structure a TOML document (a dict) into a `RunConfig`, or raise `ConfigError` with every problem."""
    parsed = parse_document(data, source)
    if parsed.problems or parsed.config is None:
        raise ConfigError(source, parsed.problems or ["could not be read as a run config"])
    return parsed.config


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: take it as a string
    except RecursionError:  # tomllib recurses per nesting level
        raise ConfigError("--set", [f"value nested too deeply to read ({len(text)} characters)"]) from None


def apply_sets(data: dict[str, Any], sets: Sequence[str], source: str = "--set") -> dict[str, Any]:
    """Apply ``key.path=value`` overrides (values parsed as TOML, bare words as strings) to a document."""
    problems = []
    for item in sets:
        key, sep, text = item.partition("=")
        parts = [p.strip() for p in key.split(".")]
        if not sep or not all(parts):
            problems.append(f"--set {item!r}: expected key.path=value, e.g. model.lora.r=8")
            continue
        table = data
        for part in parts[:-1]:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                problems.append(f"--set {item!r}: {part} is not a table")
                break
        else:
            table[parts[-1]] = _parse_value(text.strip())
    if problems:
        raise ConfigError(source, problems)
    return data


def _set_key(item: str) -> str:
    return ".".join(part.strip() for part in item.partition("=")[0].split("."))


def _blamed(line: str, sets: Sequence[str]) -> str | None:
    """``line`` (``key.path: message``) reported against the last ``--set`` that wrote at or above its key, or
    ``None``."""
    path, sep, message = line.partition(": ")
    if not sep:
        return None
    for item in reversed(sets):  # a later --set of the same key wins, as it did when applied
        key = _set_key(item)
        if path == key:
            return f"--set {item}: {message}"
        if path.startswith((f"{key}.", f"{key}[")):
            return f"--set {item}: {line}"
    return None


def blame_sets(error: ConfigError, sets: Sequence[str]) -> ConfigError:
    """``error`` with each problem a ``--set KEY=VALUE`` caused reported against that ``--set`` (not the file); the
    error names the file only when the file itself has a problem."""
    lines = [_blamed(line, sets) for line in error.problems]
    if not any(lines):
        return error
    source = "--set" if all(lines) else error.source
    return ConfigError(source, [new or old for new, old in zip(lines, error.problems, strict=True)])


def load_config(path: str | Path, sets: Sequence[str] = ()) -> RunConfig:
    """Read a TOML run config (plus ``--set`` overrides) strictly; raise `ConfigError` listing every problem, each one
    a ``--set`` caused reported against that ``--set KEY=VALUE``."""
    document = load_document(path, sets)
    try:
        return parse_config(document, str(path))
    except ConfigError as exc:
        raise blame_sets(exc, sets) from None


def load_document(path: str | Path, sets: Sequence[str] = ()) -> dict[str, Any]:
    """A TOML file as a document (a dict) with ``--set`` overrides applied; `ConfigError` when it cannot be read."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read the file ({exc.strerror or exc})"]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            str(path), [f"not UTF-8 text (TOML must be): byte 0x{raw[exc.start]:02x} at line {line}"]
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), [f"invalid TOML: {exc}"]) from None
    except RecursionError:  # tomllib recurses per nesting level: thousands of nested arrays or tables
        raise ConfigError(str(path), ["invalid TOML: nested too deeply to read"]) from None
    return apply_sets(data, sets)
