"""The house's habits, checked in the README's test command: ruff's lint rules and formatting over every Python file
of the repository, and mypy over the library's and the plugins' sources. The rules and the checker's settings are in
pyproject.toml (``[tool.ruff]``, ``[tool.mypy]``); ``scripts/format.sh`` applies what ruff can fix by itself."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Every folder holding Python: ruff checks them all.
LINTED = ("src", "plugins", "tests", "examples", "benchmarks", "scripts")
#: The sources mypy checks: the library, the bundled plugins, the example plugins (not their tests).
TYPED = (
    "src",
    *sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("plugins/*/src"), *ROOT.glob("examples/plugins/*/src")]),
)


def run_tool(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed: ./scripts/setup.sh installs it (the `test` extra of pyproject.toml)")
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )


def assert_clean(done: subprocess.CompletedProcess[str], fix: str) -> None:
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{fix}"


def test_ruff_lint_rules():
    done = run_tool("ruff", "check", "--no-cache", "--output-format", "concise", *LINTED)
    assert_clean(
        done,
        "Fix these (./scripts/format.sh applies ruff's automatic fixes); a rule broken on purpose "
        "takes `# noqa: CODE - why` on its line.",
    )


def test_ruff_format():
    done = run_tool("ruff", "format", "--no-cache", "--check", "--diff", *LINTED)
    assert_clean(done, "Run ./scripts/format.sh to format these files.")


def test_mypy_on_the_sources():
    """About 30 s on two cores with an empty cache (.mypy_cache), a second with a warm one."""
    done = run_tool("mypy", *TYPED)
    assert_clean(done, "Fix the types (a `# type: ignore[code]` only with the reason beside it).")


#: A module with a docstring line, a comment and a string literal over 120 columns (built from pieces, so that this
#: file's own lines stay under the limit).
LONG = "much longer than the limit of one hundred and twenty columns, which is what each of these lines must be"
SAMPLE = "\n".join(
    [
        f'"""A module docstring whose only line is {LONG}, so that it wraps, with more words at the end."""',
        "",
        "VALUE = 3",
        "",
        "",
        "def f(name: str) -> str:",
        f'    """A function docstring line {LONG}: it wraps too."""',
        f"    x = 1  # a trailing comment {LONG}, that moves above",
        f'    return g(f"the value {{name!r}} is {{VALUE}} and {{x}}, a sentence {LONG} {{{{braces}}}} and more", 2)',
        "",
    ]
)


def test_wrap_long_lines_keeps_the_program(tmp_path):
    """scripts/wrap_long_lines.py (run by scripts/format.sh) wraps comments, docstrings and string literals under the
    limit without changing the program: the same AST, up to the whitespace inside docstrings."""
    path = tmp_path / "sample.py"
    path.write_text(SAMPLE)
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "wrap_long_lines.py"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    wrapped = path.read_text()
    assert max(len(line) for line in wrapped.splitlines()) <= 120
    assert max(len(line) for line in SAMPLE.splitlines()) > 120

    def normalised(source: str) -> str:
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                node.value = " ".join(node.value.split())
        return ast.dump(tree)

    assert normalised(wrapped) == normalised(SAMPLE)
    # the f-string's value is the same, piece for piece, not only up to whitespace
    assert [ast.dump(n) for n in ast.walk(ast.parse(wrapped)) if isinstance(n, ast.JoinedStr)] == [
        ast.dump(n) for n in ast.walk(ast.parse(SAMPLE)) if isinstance(n, ast.JoinedStr)
    ]
    assert "# a trailing comment" in wrapped and "x = 1\n" in wrapped
