"""The errors vlmreg raises on bad input.

Each one carries a message a user can act on (what is wrong, where, and what exists instead).
The CLI prints ``str(error)`` and exits 1, with no traceback, for every subclass of `VlmregError`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "DescriptorError",
    "PluginError",
    "RegistryConflictError",
    "ResolutionError",
    "UnknownFamilyError",
    "VlmregError",
    "did_you_mean",
]


class VlmregError(Exception):
    """Base class of every error vlmreg raises on bad input, bad plugins or bad models."""


class DescriptorError(VlmregError, ValueError):
    """A `FamilyDescriptor` field holds a bad value; the message names the family and the field."""


class PluginError(VlmregError):
    """A plugin could not be loaded or does not follow the hook contract; the message names its distribution."""


class RegistryConflictError(PluginError):
    """Two plugins claim the same family name or ``model_type``; the message names both distributions."""


class ResolutionError(VlmregError, ValueError):
    """A descriptor does not fit the loaded model: a path, prefix or LoRA target that does not resolve."""


class UnknownFamilyError(ResolutionError, LookupError):
    """No installed family claims a name or ``model_type``; the message lists what is installed."""


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest candidates, or an empty string when none is close."""
    close = difflib.get_close_matches(word, [c for c in candidates if c != word], n=3, cutoff=0.6)
    if not close:
        return ""
    if len(close) == 1:
        return f" Did you mean {close[0]!r}?"
    return " Did you mean " + ", ".join(repr(c) for c in close[:-1]) + f" or {close[-1]!r}?"
