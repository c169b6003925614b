"""Console output for the CLI: rich for people, plain JSON for machines, one-line errors."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

stdout = Console(highlight=False)
stderr = Console(stderr=True, highlight=False)


def print_json(data: Any) -> None:
    """Write ``data`` as indented JSON to stdout, unstyled, so it can be piped to ``jq``."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def error(message: str) -> None:
    """Print ``message`` as an error; it is text, never markup (a path like ``[/x].toml`` or ``[data]`` shows as is)."""
    stderr.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, markup=True, emoji=False)


def escape(text: str) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(text)
