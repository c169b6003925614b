"""Environments: what the model talks to. Single-turn tasks score one answer; multi-turn ones reply.

An environment's ``step`` may return new messages, with new images (a game screen, a re-rendered
diagram) added to the run's `ImageStore` and referred to by id, like any prompt image.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from vlmreg.data.example import Example

__all__ = ["EnvStep", "Environment", "RewardFn", "SingleTurnEnvironment"]

RewardFn = Callable[[str, Any], float]


@attrs.frozen
class EnvStep:
    """The environment's answer to one completion."""

    reward: float
    done: bool
    messages: Sequence[Mapping[str, Any]] = ()
    info: Mapping[str, Any] = attrs.field(factory=dict)


class Environment(Protocol):
    def reset(self, example: Example) -> list[Mapping[str, Any]]:
        """The conversation's first messages (usually the example's)."""
        ...

    def step(self, completion: str) -> EnvStep:
        """Score a completion; when not done, return the messages the model sees next."""
        ...


class SingleTurnEnvironment:
    """One prompt, one answer, one reward."""

    def __init__(self, reward: RewardFn, system_prompt: str | None = None) -> None:
        self.reward, self.system_prompt = reward, system_prompt
        self.example: Example | None = None

    def reset(self, example: Example) -> list[Mapping[str, Any]]:
        self.example = example
        messages = list(example.messages)
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def step(self, completion: str) -> EnvStep:
        assert self.example is not None, "step() before reset()"
        return EnvStep(reward=float(self.reward(completion, self.example.answer)), done=True)
