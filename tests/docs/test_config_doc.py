"""docs/config.md's key tables equal the schema: every key of every section (nested ones found by walking the
schema, not listed here) has exactly one row, no row names a key that does not exist, and a default written as a
literal is the schema's default, as TOML spells it."""

from __future__ import annotations

import re
import tomllib
import typing
from pathlib import Path

import attrs
import pytest

from vlmreg.config import schema
from vlmreg.config.toml_out import _value

DOC = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()


def schema_sections() -> dict[str, type]:
    """Every table of the run config by its dotted name (``model``, ``model.vlm``, ``model.lora``, ``rollout``, ...)."""
    found: dict[str, type] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for field in attrs.fields(cls):
            kind = hints[field.name]
            for candidate in (kind, *typing.get_args(kind)):
                if isinstance(candidate, type) and attrs.has(candidate):
                    name = f"{prefix}{field.name}"
                    found[name] = candidate
                    walk(candidate, f"{name}.")

    walk(schema.RunConfig, "")
    return found


SECTIONS = schema_sections()


def doc_rows(section: str) -> list[tuple[str, str]]:
    """The (key, default cell) rows of the section's key table, in order."""
    match = re.search(rf"^## `\[{re.escape(section)}\]`\n(.*?)(?=^## |\Z)", DOC, re.S | re.M)
    assert match, f"docs/config.md has no section [{section}]"
    return re.findall(r"^\| `(\w+)` \| ([^|]*) \|", match.group(1), re.M)


def value_keys(section: str) -> list[str]:
    """The section's keys that hold values (its nested tables have sections of their own)."""
    return [f.name for f in attrs.fields(SECTIONS[section]) if f"{section}.{f.name}" not in SECTIONS]


def test_the_walk_finds_the_nested_sections():
    assert {
        "model",
        "model.vlm",
        "model.lora",
        "rollout",
        "trainer",
        "data",
        "reward",
        "eval",
        "broadcast",
        "logging",
    } <= set(SECTIONS)


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_key_has_exactly_one_row(section):
    rows = [key for key, _ in doc_rows(section)]
    keys = value_keys(section)
    assert sorted(set(rows)) == sorted(keys), (
        f"[{section}]: documented {sorted(set(rows) - set(keys))} do not exist, {sorted(set(keys) - set(rows))} "
        "undocumented"
    )
    assert len(rows) == len(set(rows)), f"[{section}]: a key has two rows: {[k for k in rows if rows.count(k) > 1]}"


@pytest.mark.parametrize("section", list(SECTIONS))
def test_a_literal_default_is_the_schemas(section):
    fields = {f.name: f for f in attrs.fields(SECTIONS[section])}
    for key, cell in doc_rows(section):
        literal = re.fullmatch(r"`([^`]*)`", cell.strip())
        if not literal or key not in fields:
            continue  # *family*, unset, "per algorithm", ...: said in words
        default = fields[key].default
        default = default.factory() if isinstance(default, attrs.Factory) else default
        documented = tomllib.loads(f"v = {literal.group(1)}")["v"]
        assert documented == default and type(documented) is type(default), (
            f"[{section}] {key}: documented default {cell.strip()}, the schema's {_value(default)}"
        )
