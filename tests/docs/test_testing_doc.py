"""docs/testing.md's mutation table names every module scripts/mutation.py runs, and the script's test lists exist."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "mutation.py"
DOC = (ROOT / "docs" / "testing.md").read_text()


def modules() -> dict:
    spec = importlib.util.spec_from_file_location("mutation_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MODULES


def test_every_module_the_script_runs_has_a_row_in_the_table():
    rows = set(re.findall(r"^\| `([\w-]+)` \|", DOC, re.M))
    assert rows == set(modules())


def test_every_file_the_script_names_exists():
    for name, (sources, tests) in modules().items():
        for pattern in sources:
            assert list(ROOT.glob(pattern)), (name, pattern)
        for test in tests:
            assert (ROOT / test).is_file(), (name, test)


def test_the_script_lists_its_modules_without_mutmut_running():
    out = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    assert all(f"{name}:" in out for name in modules())
