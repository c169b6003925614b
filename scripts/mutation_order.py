"""A pytest plugin for scripts/mutation.py: run a mutant's selected tests fastest first.

mutmut 3.8's fork-server runner passes a mutant's tests to pytest in set order (its plain fork runner sorts them by
duration, the fork server does not). With ``-x`` the first failing test ends the run, so running the fast tests first
ends a killed mutant's run sooner; a survivor still runs every selected test. The durations are the ones mutmut
recorded in ``mutmut-stats.json`` (the current directory while mutmut runs tests); tests it has not timed go last,
in their given order. Only the order changes, never which tests run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

_STATS = Path("mutmut-stats.json")


def _durations() -> dict[str, float]:
    try:
        return json.loads(_STATS.read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return {}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    durations = _durations()
    if durations:
        items.sort(key=lambda item: durations.get(item.nodeid, float("inf")))
