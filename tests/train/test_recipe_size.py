"""The recipe stays readable in one sitting (issue 27): ``recipe.py`` at most 350 lines, no function over 60."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

RECIPE = Path(importlib.util.find_spec("vlmreg.train.recipe").origin)  # read, not imported: no torch to load
MAX_LINES, MAX_FUNCTION_LINES = 350, 60


def long_functions(source: str, limit: int) -> list[str]:
    """``name (N lines)`` for every function or method of ``source`` longer than ``limit`` lines (decorators
    included)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - first + 1
            if length > limit:
                out.append(f"{node.name} ({length} lines)")
    return out


def test_the_rule_finds_a_long_function():
    body = "\n".join(f"        x{i} = {i}" for i in range(61))
    assert long_functions(
        f"def short():\n    pass\n\n\nclass A:\n    @staticmethod\n    def long():\n{body}\n", 60
    ) == ["long (63 lines)"]


def test_recipe_is_at_most_350_lines_with_no_function_over_60():
    source = RECIPE.read_text()
    lines = len(source.splitlines())
    assert lines <= MAX_LINES, (
        f"{RECIPE} has {lines} lines (at most {MAX_LINES}): move a coherent piece into its own module"
    )
    assert not long_functions(source, MAX_FUNCTION_LINES), (
        f"{RECIPE}: functions over {MAX_FUNCTION_LINES} lines: {long_functions(source, MAX_FUNCTION_LINES)}"
    )
