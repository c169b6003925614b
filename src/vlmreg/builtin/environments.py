"""vlmreg's built-in plugin for environments: ``single_turn`` (one prompt, one answer, one reward).

The bundled tasks' own environments (``colour_turns``) register from the tasks' built-in plugin, through the
same hook. Importing this module is cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vlmreg.envs.single_turn import SingleTurnEnvironment
from vlmreg.sdk.environment import EnvironmentSpec
from vlmreg.sdk.hookspecs import hookimpl


def single_turn(example: Any, reward: Any, store: Any) -> Any:
    """One prompt (the example's messages), one answer scored by ``reward``, done."""

    return SingleTurnEnvironment(reward)


@hookimpl
def vlmreg_register_environments(register: Callable[[EnvironmentSpec], None]) -> None:
    """Register ``single_turn``."""
    register(
        EnvironmentSpec(
            name="single_turn", make=single_turn, description="One prompt, one answer, one reward (the default)."
        )
    )
