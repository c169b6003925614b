"""Reward functions ``(completion, answer) -> float``, by name: ``exact_match``, ``first_word``, ``format``,
``math``, ``multiple_choice``; `combine` sums several with weights (the run's ``[reward] functions`` table).

Importing this package is cheap: the math reward loads Math-Verify (and sympy) on its first call.
"""

from vlmreg.rewards.answers import answer_text, normalise
from vlmreg.rewards.boxed import boxed_contents, boxed_format, last_boxed
from vlmreg.rewards.math_answer import math_answer, same_math
from vlmreg.rewards.registry import RewardFn, UnknownRewardError, WeightedReward, combine, get_reward, reward_names
from vlmreg.rewards.text import committed_choice, exact_match, first_word, multiple_choice

__all__ = [
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
]
