"""Environments: `EnvironmentSpec` (an environment registered by name through ``vlmreg_register_environments``),
the `Environment` protocol its ``make`` returns, and `EnvStep`, the environment's answer to one completion.

``make(example, reward, store)`` returns a fresh environment for one episode: an object with ``reset(example)
-> messages`` and ``step(completion) -> EnvStep`` (either may be an ``async def``), and optionally ``close()``.
``reward`` is the run's reward function (``reward(completion, answer) -> float``, a `RewardFn`) and ``store`` the
run's `ImageStore`, where the environment adds the images of later turns and refers to them by id, like any prompt
image. A task points at its environment (``Task.environment = SPEC``, the very spec its plugin registers);
``[rollout] environment`` overrides it; ``vlmreg env serve NAME`` serves one over HTTP. ``reward`` on the spec is the
reward the environment scores with when it is served on its own (a run's reward weights are then the server's
business). Nothing here imports torch or PIL.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from vlmreg.sdk.errors import UnknownEnvironmentError
from vlmreg.sdk.example import Example
from vlmreg.sdk.field_checks import check_callable, check_name, field_error

__all__ = ["EnvStep", "Environment", "EnvironmentSpec", "RewardFn", "UnknownEnvironmentError"]

RewardFn = Callable[[str, Any], float]


@attrs.frozen
class EnvStep:
    """The environment's answer to one completion."""

    reward: float
    done: bool
    messages: Sequence[Mapping[str, Any]] = ()
    info: Mapping[str, Any] = attrs.field(factory=dict)


class Environment(Protocol):
    """One episode's environment, as ``EnvironmentSpec.make`` returns it (``reset`` and ``step`` may be ``async def``;
    an optional ``close()`` runs when the episode ends)."""

    def reset(self, example: Example) -> list[Mapping[str, Any]]:
        """The conversation's first messages (usually the example's)."""
        ...

    def step(self, completion: str) -> EnvStep:
        """Score a completion; when not done, return the messages the model sees next."""
        ...


def _check_reward(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    ok = (
        isinstance(value, Mapping)
        and value
        and all(
            isinstance(k, str) and isinstance(w, (int, float)) and not isinstance(w, bool) for k, w in value.items()
        )
    )
    if not ok:
        raise field_error(instance, attribute, "must be None or a non-empty mapping of reward names to weights", value)


@attrs.frozen(kw_only=True, eq=False)
class EnvironmentSpec:
    """A registered environment: ``make(example, reward, store) -> Environment``, one per episode."""

    name: str = attrs.field(validator=check_name)
    make: Callable[[Any, Any, Any], Any] = attrs.field(
        validator=check_callable(optional=False, what="a callable (example, reward, store) -> environment")
    )
    description: str = ""
    reward: Mapping[str, float] | None = attrs.field(default=None, validator=_check_reward)

    def __call__(self, example: Any, reward: Any, store: Any) -> Any:
        """``make(example, reward, store)``: a spec is itself an environment factory, so ``Task.environment`` can
        name one (the run then takes the registered environment of that name)."""
        return self.make(example, reward, store)
