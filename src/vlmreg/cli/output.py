"""Console output for the CLI: rich for people, plain JSON for machines, one-line errors."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape as rich_escape

#: The width rich lays out to when the output is no terminal (a pipe, a file) and ``COLUMNS`` is unset: wide enough
#: that a table row or a line stays one line for ``grep`` and ``awk`` (rich's own default there is 80 columns).
PIPED_WIDTH = 1000


def _width(stream: TextIO) -> int | None:
    """``PIPED_WIDTH`` for a stream that is no terminal, unless ``COLUMNS`` says otherwise; None: rich measures."""
    if os.environ.get("COLUMNS"):
        return None
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        terminal = False
    return None if terminal else PIPED_WIDTH


class _TrimmedLines:
    """A stream's writer that drops the spaces at the end of each line: piped at ``PIPED_WIDTH``, rich pads every cell
    of a table's column to its widest (one long value made every row of `vlmreg show` 500 characters wide)."""

    def __init__(self, name: str) -> None:
        self.name, self.pending = name, ""  # "stdout" or "stderr": looked up at each write, as rich does (capture)

    @property
    def stream(self) -> TextIO:
        return getattr(sys, self.name)

    def write(self, text: str) -> int:
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        if lines:
            self.stream.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.stream.write(self.pending)
            self.pending = ""
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def _console(name: str, **kwargs: Any) -> Console:
    width = _width(getattr(sys, name))
    if width is None:
        return Console(highlight=False, **kwargs)
    return Console(highlight=False, width=width, file=_TrimmedLines(name), **kwargs)  # type: ignore[arg-type]


stdout = _console("stdout")
stderr = _console("stderr", stderr=True)


def print_json(data: Any) -> None:
    """Write ``data`` as indented JSON to stdout, unstyled, so it can be piped to ``jq``."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def error(message: str) -> None:
    """Print ``message`` as an error; it is text, never markup (a path like ``[/x].toml`` or ``[data]`` shows as is)."""
    stderr.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, markup=True, emoji=False)


def escape(text: str) -> str:
    return rich_escape(text)
