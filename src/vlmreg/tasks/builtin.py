"""vlmreg's built-in plugin: registers the bundled tasks through ``vlmreg_register_tasks``, like any plugin.

Importing it is cheap (PIL loads when a task generates data), since it loads whenever the registry does.
"""

from __future__ import annotations

from collections.abc import Callable

from vlmreg.sdk.hookspecs import hookimpl
from vlmreg.sdk.task import Task
from vlmreg.tasks import colour, colour_turns, count


@hookimpl
def vlmreg_register_tasks(register: Callable[[Task], None]) -> None:
    """Register ``colour``, ``colour_turns`` and ``count``."""
    register(colour.TASK)
    register(colour_turns.TASK)
    register(count.TASK)
