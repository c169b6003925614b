"""`Reward`: a reward function registered by name through ``vlmreg_register_rewards``.

``[reward] functions`` (and a task's ``reward``) name rewards with weights. ``fn(completion, answer) -> float`` scores
one completion's final text against the example's answer; it may be an ``async def`` (say, a request to a reward-model
server), which vlmreg awaits on its own event loop, several samples at once, each call bounded by ``timeout_s``.
Nothing here imports torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from vlmreg.sdk.field_checks import check_callable, check_name, field_error

__all__ = ["Reward"]


def _check_timeout(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise field_error(instance, attribute, "must be a positive number of seconds or None", value)


def _is_async(fn: Any) -> bool:
    """Whether calling ``fn`` gives a coroutine: an ``async def``, a partial of one, or an object with ``async def
    __call__``."""
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(type(fn), "__call__", None)  # noqa: B004 - the method, to ask whether it is async
    return not inspect.isroutine(fn) and call is not None and inspect.iscoroutinefunction(call)


@attrs.frozen(kw_only=True, eq=False)
class Reward:
    """A reward: ``fn(completion, answer) -> float``, or an ``async def`` of the same; ``timeout_s`` bounds an async
    call."""

    name: str = attrs.field(validator=check_name)
    fn: Callable[[str, Any], float | Awaitable[float]] = attrs.field(
        validator=check_callable(optional=False, what="a callable (completion, answer) -> float, or an async def of it")
    )
    description: str = ""
    timeout_s: float | None = attrs.field(default=30.0, validator=_check_timeout)

    @property
    def is_async(self) -> bool:
        """Whether ``fn`` is awaited (an ``async def``): vlmreg runs it on its event loop, with ``timeout_s``."""
        return _is_async(self.fn)
