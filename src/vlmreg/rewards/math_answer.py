"""The ``math`` reward: the last ``\\boxed{...}`` checked symbolically against the reference answer.

Parsing and comparison are Hugging Face's Math-Verify (``math_verify``: LaTeX to sympy, then equality up
to simplification and float rounding), so ``\\boxed{\\frac{1}{2}}`` matches ``0.5`` and ``\\boxed{1+x}``
matches ``x+1``. It is imported on first use, so importing `vlmreg.rewards` stays cheap.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from vlmreg.rewards.answers import answer_text
from vlmreg.rewards.boxed import last_boxed
from vlmreg.sdk.errors import VlmregError

__all__ = ["math_answer", "same_math"]

log = logging.getLogger(__name__)

#: Longer boxed answers are not parsed: no short-answer task needs them, and sympy can be slow on them.
MAX_ANSWER_CHARS = 512
#: Seconds Math-Verify may spend parsing or comparing; it times out with SIGALRM, so only in the main thread.
TIMEOUT_S = 5


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _math_verify() -> Any:
    """The ``math_verify`` module, or an error saying how to get it (a missing install is not a wrong answer)."""
    try:
        # deferred: optional, its absence is handled here
        import math_verify  # noqa: PLC0415
    except ImportError as exc:
        raise VlmregError(
            f"the math reward needs Math-Verify, a dependency of vlmreg: pip install math-verify ({exc})"
        ) from exc
    return math_verify


def _parse(latex: str) -> list[Any]:
    mv = _math_verify()
    config = [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
    return mv.parse(f"${latex}$", extraction_config=config, parsing_timeout=_timeout())


@functools.lru_cache(maxsize=4096)
def _parse_reference(latex: str) -> tuple[Any, ...]:
    """References repeat across a group of samples: parse each once."""
    return tuple(_parse(latex))


def same_math(reference: str, candidate: str) -> bool:
    """Whether two LaTeX (or plain) expressions are mathematically equal; ``False`` when either does not parse."""
    mv = _math_verify()
    if not reference.strip() or not candidate.strip() or max(len(reference), len(candidate)) > MAX_ANSWER_CHARS:
        return False
    try:
        gold = list(_parse_reference(reference))
        if not gold:
            return False
        return bool(mv.verify(gold, _parse(candidate), timeout_seconds=_timeout()))
    except Exception as exc:  # noqa: BLE001 - sympy on model output can fail in many ways; a failure is a wrong answer
        log.debug("math reward: could not compare %r with %r: %s: %s", candidate, reference, type(exc).__name__, exc)
        return False


def math_answer(completion: str, answer: Any) -> float:
    """1.0 when the last ``\\boxed{...}`` of the final text equals the answer mathematically; else 0.0.

    ``answer`` is a number, a LaTeX string (``"\\frac{1}{2}"``) or a mapping with an ``"answer"`` key.
    No ``\\boxed{}``, an unparsable one, or a wrong value gives 0.0.
    """
    if not isinstance(completion, str):
        return 0.0
    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0
    return 1.0 if same_math(answer_text(answer), boxed) else 0.0
