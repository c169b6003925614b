"""`Task`: a named source of training examples with its own reward, registered through a hook.

Tasks generate their data (images drawn with PIL, deterministic by seed), so a run needs no download.
Plugins add tasks with ``vlmreg_register_tasks(register)``. Nothing here imports torch or PIL.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from vlmreg.sdk.field_checks import check_callable, check_name, field_error

__all__ = ["Task"]


def _check_reward(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    ok = (
        isinstance(value, Mapping)
        and value
        and all(
            isinstance(k, str) and isinstance(w, (int, float)) and not isinstance(w, bool) for k, w in value.items()
        )
    )
    if not ok:
        raise field_error(instance, attribute, "must be a non-empty mapping of reward names to weights", value)


@attrs.frozen(kw_only=True, eq=False)
class Task:
    """A task: ``generate(n, seed, store)`` returns ``n`` `vlmreg.data.Example` objects, images added to ``store``.

    ``reward`` maps reward function names (see ``vlmreg.rewards``) to weights; the run's ``[reward]`` section
    can replace it. ``system_prompt`` is put before every prompt unless the run's ``[data]`` sets one.
    ``choices`` lists the possible answers when there are few (used by the format warm-up). ``environment``,
    when set, is ``environment(example, reward_fn) -> Environment`` for multi-turn tasks; unset: one turn.
    """

    name: str = attrs.field(validator=check_name)
    generate: Callable[[int, int, Any], list[Any]] = attrs.field(validator=check_callable(optional=False))
    reward: Mapping[str, float] = attrs.field(validator=_check_reward)
    description: str = ""
    system_prompt: str | None = None
    choices: tuple[str, ...] | None = attrs.field(default=None, converter=lambda v: tuple(v) if v is not None else None)
    environment: Callable[..., Any] | None = attrs.field(default=None, validator=check_callable(optional=True))

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "reward", types.MappingProxyType(dict(self.reward)))
