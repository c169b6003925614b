"""docs/config.md documents every key of every config section, and nothing that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from vlmreg.config import schema

DOC = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
SECTIONS = {
    "model": schema.ModelSection,
    "model.vlm": schema.VlmSection,
    "model.lora": schema.LoraSection,
    "rollout": schema.RolloutSection,
    "trainer": schema.TrainerSection,
    "data": schema.DataSection,
    "reward": schema.RewardSection,
    "eval": schema.EvalSection,
    "broadcast": schema.BroadcastSection,
    "logging": schema.LoggingSection,
}


def test_every_section_of_the_schema_is_listed():
    top = {f.name for f in attrs.fields(schema.RunConfig)}
    assert top == {name for name in SECTIONS if "." not in name}


@pytest.mark.parametrize("section", SECTIONS)
def test_every_key_has_a_row(section):
    match = re.search(rf"^## `\[{re.escape(section)}\]`\n(.*?)(?=^## |\Z)", DOC, re.S | re.M)
    assert match, f"docs/config.md has no section [{section}]"
    rows = set(re.findall(r"^\| `(\w+)` \|", match.group(1), re.M))
    keys = {f.name for f in attrs.fields(SECTIONS[section]) if not attrs.has(f.type if isinstance(f.type, type) else type(None))}
    keys -= {"vlm", "lora"}
    assert rows == keys
