"""vlmreg's bundled reward functions, registered through ``vlmreg_register_rewards`` like a third party's.

The functions live next to what they read (`vlmreg.rewards.text`, `boxed`, `math_answer`); this module only names
them. Importing it is cheap (the math reward loads Math-Verify on its first call), since it loads with the plugins.
"""

from __future__ import annotations

from collections.abc import Callable

from vlmreg.rewards.boxed import boxed_format
from vlmreg.rewards.math_answer import math_answer
from vlmreg.rewards.text import exact_match, first_word, multiple_choice
from vlmreg.sdk.hookspecs import hookimpl
from vlmreg.sdk.reward import Reward

BUILTIN = (
    Reward(
        name="exact_match", fn=exact_match, description="1.0 when the whole final text equals the answer (normalised)"
    ),
    Reward(name="first_word", fn=first_word, description="1.0 when the final text starts with the answer's words"),
    Reward(
        name="format",
        fn=boxed_format,
        description="1.0 when the final text has exactly one closed, non-empty \\boxed{}",
    ),
    Reward(
        name="math",
        fn=math_answer,
        description="1.0 when the last \\boxed{} equals the answer mathematically (Math-Verify)",
    ),
    Reward(
        name="multiple_choice",
        fn=multiple_choice,
        description="1.0 when the completion commits to the correct choice and no other",
    ),
)


@hookimpl
def vlmreg_register_rewards(register: Callable[[Reward], None]) -> None:
    """Register ``exact_match``, ``first_word``, ``format``, ``math`` and ``multiple_choice``."""
    for reward in BUILTIN:
        register(reward)
