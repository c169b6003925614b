"""A corpus of bad configs (tests/config/bad/*.toml): each fails `vlmreg validate` with its expected lines, exit 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmreg.cli import main

BAD = sorted((Path(__file__).parent / "bad").glob("*.toml"))


def expectations(path: Path) -> list[str]:
    text = path.read_bytes().decode("utf-8", "replace")  # not_utf8.toml is, on purpose, not UTF-8
    return [line.removeprefix("# expect: ").rstrip("\n") for line in text.splitlines() if line.startswith("# expect: ")]


def test_the_corpus_is_large_and_every_file_says_what_it_expects():
    assert len(BAD) >= 30
    assert all(expectations(p) for p in BAD)


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_config_is_rejected_with_its_messages(path, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: nothing is "already downloaded"
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [" ".join(line.split()) for line in err.splitlines()]
    assert lines[0].startswith(f"error: {path}: "), lines[0]
    for expected in expectations(path):
        assert any(expected in line for line in lines), f"{expected!r} not in:\n" + "\n".join(lines)
