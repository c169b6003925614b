"""The one rule: no family knowledge in the core, not even in comments. Family names live in plugins."""

from __future__ import annotations

import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "src" / "vlmreg"
FAMILY_WORDS = re.compile(r"qwen|llava|gemma|internvl|idefics|paligemma|mllama|pixtral|smolvlm", re.I)


def test_no_family_name_in_core_code():
    hits = []
    for path in CORE.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if FAMILY_WORDS.search(line):
                hits.append(f"{path.relative_to(CORE)}:{number}: {line.strip()}")
    assert hits == [], "family knowledge in the core:\n" + "\n".join(hits)


def test_no_model_type_branches_in_core():
    pattern = re.compile(r"model_type\s*(==|!=|in)\s*[\"'(\[]")
    hits = [str(p.relative_to(CORE)) for p in CORE.rglob("*.py") if pattern.search(p.read_text())]
    assert hits == []
