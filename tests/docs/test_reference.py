"""docs/reference.md documents every descriptor field, every hook, and every command."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from vlmreg import FamilyDescriptor, LoraPreset, Objective, Task, ThinkingMode, VisionTokens
from vlmreg.cli import build_parser
from vlmreg.sdk.plugins import PluginHost

REFERENCE = (Path(__file__).resolve().parents[2] / "docs" / "reference.md").read_text()


def section(title: str) -> str:
    match = re.search(rf"^## `?{re.escape(title)}`?\n(.*?)(?=^## |\Z)", REFERENCE, re.S | re.M)
    assert match, f"docs/reference.md has no section '## {title}'"
    return match.group(1)


@pytest.mark.parametrize("cls", [FamilyDescriptor, LoraPreset, ThinkingMode, VisionTokens, Task, Objective])
def test_every_field_has_a_row(cls):
    rows = set(re.findall(r"^\| `(\w+)` \|", section(cls.__name__), re.M))
    fields = {f.name for f in attrs.fields(cls)}
    assert fields - rows == set(), f"undocumented {cls.__name__} fields"
    assert rows - fields == set(), f"documented {cls.__name__} fields that do not exist"


def test_every_hook_has_a_section():
    documented = set(re.findall(r"^### `(vlmreg_\w+)\(", section("Hooks"), re.M))
    assert documented == set(PluginHost().hook_names())


def test_every_command_is_documented():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name in commands:
        assert f"`vlmreg {name}" in section("Commands"), f"command {name!r} is not in docs/reference.md"


def test_required_fields_are_the_ones_marked_required():
    required = {f.name for f in attrs.fields(FamilyDescriptor) if f.default is attrs.NOTHING}
    marked = set(re.findall(r"^\| `(\w+)` \| [^|]*\*\*required\*\*", section("FamilyDescriptor"), re.M))
    assert (
        required
        == marked
        == {"name", "model_types", "vision_encoder_attr", "language_model_attr", "lm_head_attr", "tiny_config"}
    )
