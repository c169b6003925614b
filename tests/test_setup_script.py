"""scripts/setup.sh installs into .venv once, skips the installs while .venv is current, and reinstalls when a
pyproject.toml changes; one line of output either way. Run on a copy of the script in a folder whose .venv/bin/python
is a stand-in that records what it is asked to do (no pip, no network)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../../calls.log"
if [ "$1" = "-c" ] && [[ "$2" == *print* ]]; then echo "done: stand-in"; fi
"""


def make_checkout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "vlmreg"\n')
    for name in ("vlmreg-a", "vlmreg-b"):
        (tmp_path / "plugins" / name).mkdir(parents=True)
        (tmp_path / "plugins" / name / "pyproject.toml").write_text(f'[project]\nname = "{name}"\n')
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STAND_IN)
    python.chmod(0o755)
    return tmp_path


def setup(checkout: Path) -> tuple[list[str], list[str]]:
    """Run setup.sh; its output lines and the pip installs the stand-in python was asked for."""
    log = checkout / "calls.log"
    log.unlink(missing_ok=True)
    done = subprocess.run(["bash", str(checkout / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    return done.stdout.splitlines(), [c for c in calls if c.startswith("-m pip install")]


def test_setup_installs_once_then_skips_until_a_pyproject_changes(tmp_path):
    checkout = make_checkout(tmp_path)
    out, installs = setup(checkout)
    assert len(out) == 1 and out[0].startswith("setup.sh: .venv has no install stamp: installing"), out
    assert out[0].endswith("done: stand-in")
    assert len(installs) == 1 and "-e plugins/vlmreg-a/ -e plugins/vlmreg-b/" in installs[0]

    out, installs = setup(checkout)
    assert out == [
        (
            "setup.sh: .venv is current (pyproject.toml, the 2 plugins' and this script unchanged since its install): "
            "skipping the installs"
        )
    ]
    assert installs == []

    (checkout / "plugins" / "vlmreg-b" / "pyproject.toml").write_text('[project]\nname = "vlmreg-b"\nversion = "2"\n')
    out, installs = setup(checkout)
    assert out[0].startswith("setup.sh: .venv is out of date (a pyproject.toml or this script changed): installing"), (
        out
    )
    assert len(installs) == 1


def test_a_failed_install_leaves_no_stamp(tmp_path):
    checkout = make_checkout(tmp_path)
    python = checkout / ".venv" / "bin" / "python"
    python.write_text(STAND_IN + 'if [ "$2" = "pip" ]; then exit 1; fi\n')
    done = subprocess.run(["bash", str(checkout / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert not (checkout / ".venv" / ".setup-stamp").exists()
    python.write_text(STAND_IN)
    out, installs = setup(checkout)
    assert "installing" in out[0] and len(installs) == 1
