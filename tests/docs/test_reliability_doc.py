"""docs/reliability.md cites only test functions that exist, and its totals are right.

Everything is read with `ast`, nothing is imported, so this is fast: a function counts once however many cases its
parametrization makes (the page says so).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "reliability.md").read_text()
REFERENCE = re.compile(r"(tests/[\w/]+\.py)::(\w+)(?:\[[^\]`]*\])?")
END_OF_AREAS = "## What is not promised"


@cache
def functions_in(path: str) -> frozenset[str]:
    """The names of the ``def test_...`` functions in ``path`` (module level or in a class)."""
    tree = ast.parse((ROOT / path).read_text(), filename=path)
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
    )


def areas() -> dict[str, set[tuple[str, str]]]:
    """Each ``## `` area of the page (``### `` parts belong to theirs) and the functions its tables cite."""
    body = DOC[: DOC.index(END_OF_AREAS)]
    found: dict[str, set[tuple[str, str]]] = {}
    for match in re.finditer(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", body, re.M | re.S):
        found[match.group(1).strip()] = {(m.group(1), m.group(2)) for m in REFERENCE.finditer(match.group(2))}
    return found


def totals_section() -> str:
    return DOC[DOC.index("## Totals") :]


def table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("| ---"):
            rows.append([cell.strip().strip("*`") for cell in line.strip().strip("|").split("|")])
    return rows


def cited() -> set[tuple[str, str]]:
    return set().union(*areas().values())


def test_every_reference_names_an_existing_test_function():
    references = [(m.group(1), m.group(2)) for m in REFERENCE.finditer(DOC)]
    assert len(references) > 50
    missing = [
        f"{path}::{name}" for path, name in references if not (ROOT / path).is_file() or name not in functions_in(path)
    ]
    assert not missing, f"docs/reliability.md cites test functions that do not exist: {missing}"


def test_every_area_of_the_issue_has_a_section_that_cites_tests():
    expected = {
        "Data loss and run directories",
        "Error printing",
        "Damaged state",
        "Silent success",
        "Plugins",
        "Timeouts",
        "Server",
        "Security",
    }
    found = areas()
    assert set(found) == expected
    assert all(found.values()), [area for area, refs in found.items() if not refs]
    for part in ("Weights endpoint", "API keys", "Weight-group token", "Dataset paths", "vLLM endpoints"):
        assert re.search(rf"^### {re.escape(part)}", DOC, re.M), part


def area_totals() -> dict[str, int]:
    rows = table_rows(totals_section().split("\n\n| file |")[0])
    return {name: int(count) for name, count in rows[1:]}


def test_the_totals_per_area_and_overall_count_the_cited_functions():
    found = areas()
    stated = area_totals()
    assert stated == {**{area: len(refs) for area, refs in found.items()}, "overall": len(cited())}
    assert "2026-11-23" in totals_section() and "not parametrized cases" in totals_section()


def test_the_file_table_counts_the_functions_in_each_file_and_those_cited():
    rows = table_rows(totals_section().split("\n\n| file |", 1)[1].join(["| file |", ""]))
    header, *files, total = rows
    assert header[0] == "file" and total[0] == "all"
    by_file: dict[str, int] = {}
    for path, _ in cited():
        by_file[path] = by_file.get(path, 0) + 1
    assert {row[0] for row in files} == set(by_file), "the file table must list exactly the files the page cites"
    for path, in_file, in_page in files:
        assert int(in_file) == len(functions_in(path)), f"{path}: {len(functions_in(path))} test functions"
        assert int(in_page) == by_file[path], f"{path}: {by_file[path]} cited"
    assert int(total[1]) == sum(len(functions_in(row[0])) for row in files)
    assert int(total[2]) == len(cited())


def test_the_bad_config_corpus_size_is_the_one_stated():
    count = len(list((ROOT / "tests" / "config" / "bad").glob("*.toml")))
    assert f"{count} files in `tests/config/bad/`" in DOC


@pytest.mark.parametrize("page", ["README.md", "docs/training.md"])
def test_the_page_is_linked(page):
    assert "reliability.md" in (ROOT / page).read_text()
