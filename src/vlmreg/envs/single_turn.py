"""The built-in single-turn environment: one prompt, one answer, scored by the run's reward. The protocol every
environment follows (`Environment`, `EnvStep`, `EnvironmentSpec`) is the SDK's, `vlmreg.sdk.environment`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vlmreg.sdk.environment import EnvStep, RewardFn
from vlmreg.sdk.example import Example

__all__ = ["SingleTurnEnvironment"]


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
