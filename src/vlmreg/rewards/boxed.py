"""``\\boxed{...}`` answers: find them with nested braces, and the ``format`` reward that asks for exactly one."""

from __future__ import annotations

from typing import Any

__all__ = ["boxed_contents", "boxed_format", "last_boxed"]

_BOXED = "\\boxed"


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` matching the ``{`` at ``start``, or ``None`` when it is never closed.

    Escaped braces (``\\{``, ``\\}``) are literal characters in LaTeX, so they do not change the depth.
    """
    depth = 0
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def boxed_contents(text: str) -> list[str]:
    """The contents of every complete top-level ``\\boxed{...}`` in ``text``, in order.

    Nested braces are kept (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``); a ``\\boxed`` inside another
    is part of the outer content; an unclosed ``\\boxed{`` ends the search.
    """
    found: list[str] = []
    pos = text.find(_BOXED)
    while pos != -1:
        brace = pos + len(_BOXED)
        while brace < len(text) and text[brace] == " ":
            brace += 1
        if brace < len(text) and text[brace] == "{":
            end = _closing_brace(text, brace)
            if end is None:
                break
            found.append(text[brace + 1 : end])
            pos = text.find(_BOXED, end + 1)
        else:
            pos = text.find(_BOXED, pos + len(_BOXED))
    return found


def last_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` (stripped), or ``None`` when there is none."""
    contents = boxed_contents(text)
    return contents[-1].strip() if contents else None


def boxed_format(completion: str, answer: Any = None) -> float:
    """1.0 when the answer has exactly one ``\\boxed{...}``, closed and not empty; else 0.0.

    A second ``\\boxed`` anywhere (nested, unclosed or after the first) makes it 0.0: hedging between answers
    is not a format. The answer is not looked at.
    """
    if not isinstance(completion, str):
        return 0.0
    text = completion
    contents = boxed_contents(text)
    return 1.0 if text.count(_BOXED) == 1 and len(contents) == 1 and contents[0].strip() else 0.0
