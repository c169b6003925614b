"""vlmreg's built-in plugin: registers the bundled tasks through ``vlmreg_register_tasks``, like any plugin, and
their environments (``colour_turns``, ``crafter``) through ``vlmreg_register_environments``.

Importing it is cheap (PIL loads when a task generates data), since it loads whenever the registry does.
"""

from __future__ import annotations

from collections.abc import Callable

from vlmreg.sdk.environment import EnvironmentSpec
from vlmreg.sdk.hookspecs import hookimpl
from vlmreg.sdk.task import Task
from vlmreg.tasks import colour, colour_order, colour_turns, count, crafter, missing_colour


@hookimpl
def vlmreg_register_tasks(register: Callable[[Task], None]) -> None:
    """Register ``colour``, ``colour_order``, ``colour_turns``, ``count``, ``crafter`` and ``missing_colour``."""
    register(colour.TASK)
    register(colour_order.TASK)
    register(colour_turns.TASK)
    register(count.TASK)
    register(crafter.TASK)
    register(missing_colour.TASK)


@hookimpl
def vlmreg_register_environments(register: Callable[[EnvironmentSpec], None]) -> None:
    """Register the ``colour_turns`` and ``crafter`` environments (the tasks of those names point at them)."""
    register(colour_turns.ENVIRONMENT)
    register(crafter.ENVIRONMENT)
