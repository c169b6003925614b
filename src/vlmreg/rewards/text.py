"""Text rewards: ``exact_match``, ``first_word`` and ``multiple_choice``, on normalised final text (see `answers`)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from vlmreg.rewards.answers import answer_text, normalise
from vlmreg.rewards.boxed import last_boxed

__all__ = ["committed_choice", "exact_match", "first_word", "multiple_choice"]

_ANSWER_CUE = re.compile(r"answer\s*(?:is|:)", re.IGNORECASE)


def exact_match(completion: str, answer: Any) -> float:
    """1.0 when the whole final text equals the answer after normalising; else 0.0."""
    if not isinstance(completion, str):
        return 0.0
    target = normalise(answer_text(answer))
    return 1.0 if target and normalise(completion) == target else 0.0


def first_word(completion: str, answer: Any) -> float:
    """1.0 when the final text starts with the answer's words (its first word, for a one-word answer); else 0.0.

    What follows is ignored, so a short answer is enough: ``"Red, I think"`` scores 1.0 against ``"red"``.
    """
    if not isinstance(completion, str):
        return 0.0
    target = normalise(answer_text(answer)).split()
    words = normalise(completion).split()
    return 1.0 if target and words[: len(target)] == target else 0.0


def _choices(answer: Any) -> tuple[str, list[str]]:
    """The correct choice and every offered choice (the answer alone when no choices are given)."""
    correct = answer_text(answer).strip()
    offered = answer.get("choices") if isinstance(answer, Mapping) else None
    if not isinstance(offered, Sequence) or isinstance(offered, str):
        offered = ()
    choices = [text for text in (str(c).strip() for c in offered) if text]
    if correct and correct not in choices:
        choices.append(correct)
    return correct, choices


def _pattern(choice: str) -> re.Pattern[str]:
    """A whole-word pattern for one choice; a single letter matches only in the case given (``A``, not ``a``)."""
    words = r"\s+".join(re.escape(w) for w in choice.split())
    flags = 0 if len(choice) == 1 and choice.isalpha() else re.IGNORECASE
    return re.compile(rf"(?<![\w']){words}(?![\w'])", flags)


def _scope(text: str) -> str:
    """Where the commitment is: the last ``\\boxed{}``, else the text after the last "answer is"/"answer:"."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    cues = list(_ANSWER_CUE.finditer(text))
    return text[cues[-1].end() :] if cues else text


def committed_choice(completion: str, choices: Sequence[str]) -> str | None:
    """The one choice the completion commits to, or ``None`` when it names none or several.

    A choice inside a longer one (``green`` in ``dark green``) does not count as named there.
    """
    scope = _scope(completion)
    spans = {choice: [m.span() for m in _pattern(choice).finditer(scope)] for choice in choices}
    named = []
    for choice, own in spans.items():
        longer = [s for other, found in spans.items() if other != choice and len(other) > len(choice) for s in found]
        if any(not any(a <= start and end <= b for a, b in longer) for start, end in own):
            named.append(choice)
    return named[0] if len(named) == 1 else None


def multiple_choice(completion: str, answer: Any) -> float:
    """1.0 when the completion commits to the correct choice; else 0.0 (a wrong one, none, or several).

    ``answer`` is the correct choice, or a mapping ``{"answer": "B", "choices": ["A", "B", "C", "D"]}``; the
    choices are what a hedging completion is caught naming. The commitment is read from the last ``\\boxed{}``,
    else from after the last "answer is" / "answer:", else from the whole final text.
    """
    if not isinstance(completion, str):
        return 0.0
    correct, choices = _choices(answer)
    if not correct:
        return 0.0
    return 1.0 if committed_choice(completion, choices) == correct else 0.0
