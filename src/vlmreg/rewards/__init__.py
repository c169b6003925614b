"""Reward functions ``(completion, answer) -> float`` by name, from the reward registry: the bundled ``exact_match``,
``first_word``, ``format``, ``math``, ``multiple_choice`` and any a plugin registers (``vlmreg_register_rewards``,
sync or ``async def``); `combine` sums several with weights (the run's ``[reward] functions`` table).

Importing this package is cheap: the math reward loads Math-Verify (and sympy) on its first call.
"""

from vlmreg.rewards.answers import answer_text, normalise
from vlmreg.rewards.boxed import boxed_contents, boxed_format, last_boxed
from vlmreg.rewards.math_answer import math_answer, same_math
from vlmreg.rewards.registry import (
    MAX_CONCURRENCY,
    RewardError,
    RewardFn,
    UnknownRewardError,
    WeightedReward,
    combine,
    get_reward,
    reward_names,
    unknown_reward_message,
)
from vlmreg.rewards.text import committed_choice, exact_match, first_word, multiple_choice

__all__ = [
    "MAX_CONCURRENCY",
    "RewardError",
    "RewardFn",
    "UnknownRewardError",
    "WeightedReward",
    "answer_text",
    "boxed_contents",
    "boxed_format",
    "combine",
    "committed_choice",
    "exact_match",
    "first_word",
    "get_reward",
    "last_boxed",
    "math_answer",
    "multiple_choice",
    "normalise",
    "reward_names",
    "same_math",
    "unknown_reward_message",
]
