"""vlmreg's built-in plugin: registers the bundled tasks through ``vlmreg_register_tasks``, like any plugin."""

from __future__ import annotations

from vlmreg.sdk.hookspecs import hookimpl


@hookimpl
def vlmreg_register_tasks(register):
    """Placeholder until the bundled tasks land; registers nothing yet."""
