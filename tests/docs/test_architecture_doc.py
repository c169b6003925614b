"""docs/architecture.md against the code: its table of rooms is `LAYERS` (which tests/test_import_graph.py enforces),
read bottom up, and every module or name its data path cites exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_import_graph import LAYERS

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"


def section(title: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def rooms_table() -> list[tuple[str, frozenset[str]]]:
    """(room, what it may import) for each row of the page's table, in the page's order."""
    rows = []
    for line in section("The rooms").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        allowed = frozenset() if cells[2] == "nothing" else frozenset(re.findall(r"`([\w]+)`", cells[2]))
        rows.append((cells[0].strip("`"), allowed))
    return rows


def test_the_page_s_table_is_the_enforced_one():
    rows = rooms_table()
    assert len(rows) == len({room for room, _ in rows}), "a room listed twice"
    assert dict(rows) == LAYERS


def test_the_table_reads_from_the_bottom_up():
    """Each room may import only rooms listed above it on the page."""
    seen: set[str] = set()
    for room, allowed in rooms_table():
        assert allowed <= seen, f"{room} may import {sorted(allowed - seen)}, listed below it"
        seen.add(room)


def cited_names(text: str) -> set[str]:
    """The dotted names in backticks that start with a room: ``train.source``, ``train.collect.RolloutBatch``."""
    return {n for n in re.findall(r"`([a-z_]+(?:\.\w+)+)`", text) if n.split(".")[0] in LAYERS}


def top_level_names(file: Path) -> set[str]:
    """What a module defines or imports at its top level."""
    names: set[str] = set()
    for node in ast.parse(file.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def exists(name: str) -> bool:
    """``room.module[.Name]``: the module's file exists and defines or imports ``Name`` at its top level."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT / "src" / "vlmreg" / Path(*parts[:cut])
        file = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if file.is_file():
            rest = parts[cut:]
            if not rest:
                return True
            return len(rest) == 1 and rest[0] in top_level_names(file)
    return False


def test_every_module_the_data_path_cites_exists():
    names = cited_names(section("One step, as data"))
    assert len(names) > 20
    missing = sorted(n for n in names if not exists(n))
    assert missing == [], f"docs/architecture.md cites what does not exist: {missing}"


def test_the_checks_can_fail():
    assert exists("train.collect.RolloutBatch") and exists("modeling.logprobs") and exists("rewards.combine")
    assert (
        not exists("train.collect.NoSuchThing") and not exists("train.nowhere") and not exists("modeling.attention.x.y")
    )
