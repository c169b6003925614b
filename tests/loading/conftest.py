"""Tests here run offline, as the machines that run them are: a Hub id is looked for in the local cache only."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
