"""Reward functions by name, and `combine`, which turns a ``{name: weight}`` table into one reward.

A reward function is ``(completion: str, answer) -> float``. Each one returns 0.0, never raises, on any
completion a model can produce; an unknown name is an `UnknownRewardError` with a suggestion.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from vlmreg.rewards.boxed import boxed_format
from vlmreg.rewards.math_answer import math_answer
from vlmreg.rewards.text import exact_match, first_word, multiple_choice
from vlmreg.sdk.errors import VlmregError, did_you_mean

__all__ = ["RewardFn", "UnknownRewardError", "WeightedReward", "combine", "get_reward", "reward_names"]

RewardFn = Callable[[str, Any], float]

_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "first_word": first_word,
    "format": boxed_format,
    "math": math_answer,
    "multiple_choice": multiple_choice,
}


class UnknownRewardError(VlmregError, LookupError):
    """No reward function has the name; the message lists them."""


def reward_names() -> list[str]:
    """The names of the reward functions, sorted."""
    return sorted(_REWARDS)


def unknown_reward_message(name: str) -> str:
    """``unknown reward 'x'. Did you mean 'y'? Rewards: ...``: the one wording used everywhere."""
    return f"unknown reward {name!r}.{did_you_mean(name, _REWARDS)} Rewards: {', '.join(reward_names())}"


def get_reward(name: str) -> RewardFn:
    """The reward function called ``name``, or `UnknownRewardError`."""
    try:
        return _REWARDS[name]
    except KeyError:
        raise UnknownRewardError(unknown_reward_message(name)) from None


def _check_weights(instance: Any, attribute: attrs.Attribute, weights: Mapping[str, float]) -> None:
    if not weights:
        raise ValueError("combine() needs at least one reward name and weight")
    unknown = [name for name in weights if name not in _REWARDS]
    if unknown:
        raise UnknownRewardError("; ".join(unknown_reward_message(name) for name in unknown))
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise TypeError(f"reward {name!r}: weight must be a number (got {weight!r})")


@attrs.frozen
class WeightedReward:
    """A weighted sum of named reward functions; call it like one reward function."""

    weights: Mapping[str, float] = attrs.field(converter=lambda w: dict(w), validator=_check_weights)

    def scores(self, completion: str, answer: Any) -> dict[str, float]:
        """Each function's unweighted score, for logging next to the total."""
        return {name: float(_REWARDS[name](completion, answer)) for name in self.weights}

    def __call__(self, completion: str, answer: Any) -> float:
        scores = self.scores(completion, answer)
        return float(sum(self.weights[name] * score for name, score in scores.items()))


def combine(weights: Mapping[str, float]) -> WeightedReward:
    """One reward: the sum of ``weight * function(completion, answer)`` over ``weights``; names are checked now."""
    return WeightedReward(weights)
