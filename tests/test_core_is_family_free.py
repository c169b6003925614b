"""The one rule: no family knowledge in the core, not even in comments. Family names live in plugins."""

from __future__ import annotations

import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "src" / "vlmreg"
FAMILY_WORDS = re.compile(r"qwen|llava|gemma|internvl|idefics|paligemma|mllama|pixtral|smolvlm|glm4|onevision", re.I)


def lines_matching(pattern: re.Pattern[str]) -> list[str]:
    """Every line of the core's Python (comments included) that the pattern finds, as ``path:line: text``."""
    hits = []
    for path in CORE.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(CORE)}:{number}: {line.strip()}")
    return hits


def test_no_family_name_in_core_code():
    hits = lines_matching(FAMILY_WORDS)
    assert hits == [], "family knowledge in the core:\n" + "\n".join(hits)


# Family knowledge under generic names: one family's special tokens, model-input names, module names and paths.
FAMILY_TOKENS = re.compile(
    r"</?think>|<\|im_|<\|image_pad|<\|vision_|<start_of_image>|<end_of_turn>|\[IMG"
    r"|mm_token_type_ids|\btoken_type_ids|image_grid_thw|pixel_values|pixel_attention_mask|image_sizes"
    r"|image_token_index|image_token_id\b|\b(q|k|v|o|gate|up|down)_proj\b|[\"'}]\.layers\b|\.layers[\"']"
)


def test_no_family_tokens_inputs_or_module_names_in_core_code():
    hits = lines_matching(FAMILY_TOKENS)
    assert hits == [], "family tokens, input names or module names in the core:\n" + "\n".join(hits)


def test_the_token_check_can_fail():
    for line in (
        '_THINK_END = "</think>"',
        'if "mm_token_type_ids" in names:',
        'getattr(c, "image_token_index")',
        'f"{x}.layers"',
        'LANGUAGE = ("q_proj",)',
    ):
        assert FAMILY_TOKENS.search(line), line


def test_no_model_type_branches_in_core():
    pattern = re.compile(r"model_type\s*(==|!=|in)\s*[\"'(\[]")
    hits = [str(p.relative_to(CORE)) for p in CORE.rglob("*.py") if pattern.search(p.read_text())]
    assert hits == []
