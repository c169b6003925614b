"""Reading completions and reference answers the same way for every reward.

Rewards see the completion's answer: the episode runner has already removed the reasoning (the text
before the family's thinking end marker, `vlmreg.rollout.episodes.strip_reasoning`).
Normalising case-folds, collapses whitespace and strips punctuation from the ends of each word, so
``"Red."`` matches ``"red"`` and ``"(B)"`` matches ``"B"``, while ``"3.5"`` stays ``"3.5"``.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

__all__ = ["answer_text", "normalise"]

_EDGE_PUNCTUATION = string.punctuation + "“”‘’«»…"


def normalise(text: str) -> str:
    """Case-folded words, punctuation stripped from each word's ends, joined by single spaces."""
    words = (word.strip(_EDGE_PUNCTUATION) for word in text.casefold().split())
    return " ".join(word for word in words if word)


def answer_text(answer: Any) -> str:
    """The reference answer as text: ``answer["answer"]`` for a mapping, else ``str(answer)``; ``None`` is empty."""
    if isinstance(answer, Mapping):
        answer = answer.get("answer")
    return "" if answer is None else str(answer)
