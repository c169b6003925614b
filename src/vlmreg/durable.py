"""Making written files survive a power cut: fsync a file, a folder's entries, or a whole tree before a rename."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "fsync_file", "fsync_tree"]


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make a folder's entries (new files, renames) durable; a no-op where folders cannot be opened or synced."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Every file under ``folder``, then every folder (deepest first), then ``folder`` itself."""
    paths = sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True)
    for path in paths:
        if path.is_file():
            fsync_file(path)
    for path in paths:
        if path.is_dir():
            fsync_dir(path)
    fsync_dir(folder)
