"""The errors vlmreg raises on bad input.

Each one carries a message a user can act on (what is wrong, where, and what exists instead).
The CLI prints ``str(error)`` and exits 1, with no traceback, for every subclass of `VlmregError`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

__all__ = [
    "DescriptorError",
    "PluginError",
    "RegistryConflictError",
    "RequestError",
    "ResolutionError",
    "RewardError",
    "UnknownEngineError",
    "UnknownEnvironmentError",
    "UnknownFamilyError",
    "UnknownObjectiveError",
    "UnknownRewardError",
    "UnknownSinkError",
    "UnknownTaskError",
    "UnknownTransportError",
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


class UnknownTaskError(VlmregError, LookupError):
    """No installed task has the name; the message lists the tasks."""


class UnknownEngineError(VlmregError, LookupError):
    """No installed rollout engine has the name; the message lists the engines."""


class UnknownSinkError(VlmregError, LookupError):
    """No installed metrics sink has the name; the message lists the sinks."""


class UnknownObjectiveError(VlmregError, LookupError):
    """No installed objective has the name; the message lists the objectives."""


class UnknownTransportError(VlmregError, LookupError):
    """No installed weight transport has the name; the message lists the transports, with did-you-mean."""


class UnknownRewardError(VlmregError, LookupError):
    """No installed reward function has the name; the message lists them, with did-you-mean."""


class UnknownEnvironmentError(VlmregError, LookupError):
    """No registered environment has this name; the message lists them, with did-you-mean."""


class RequestError(VlmregError):
    """A request a server will not serve (``vlmreg serve``, a transport's receiver): HTTP ``status``, an OpenAI error
    ``kind``, the offending ``param`` and an optional ``code``; the server answers with `body`."""

    def __init__(
        self,
        param: str | None,
        message: str,
        *,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        self.param, self.message, self.status, self.kind, self.code = param, message, status, kind, code
        super().__init__(f"{param}: {message}" if param else message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


class RewardError(VlmregError):
    """A reward function raised, timed out or returned no number; the message names the reward and the sample.

    ``reward`` is the reward's name, ``reason`` what went wrong (``"timed out after 2 s"``), ``completion`` the text it
    scored, ``sample`` the sample's index in the step's batch and ``example`` its example id, when known.
    """

    #: How many characters of the completion the message quotes.
    PREVIEW_CHARS = 60

    def __init__(
        self, reward: str, reason: str, completion: object = None, sample: int | None = None, example: str | None = None
    ) -> None:
        self.reward, self.reason, self.completion, self.sample, self.example = (
            reward,
            reason,
            completion,
            sample,
            example,
        )
        super().__init__(self._message())

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.reward, self.reason, self.completion, self.sample, self.example))

    def _message(self) -> str:
        text = self.completion
        if isinstance(text, str) and len(text) > self.PREVIEW_CHARS:
            preview = repr(text[: self.PREVIEW_CHARS]) + "..."
        else:
            preview = repr(text)
        if self.sample is None:
            where = f"completion {preview}"
        else:
            example = f"example {self.example}, " if self.example else ""
            where = f"sample {self.sample} ({example}completion {preview})"
        return f"reward {self.reward!r} {self.reason} on {where}"

    def on_sample(self, sample: int, example: str | None = None) -> RewardError:
        """The same error naming the sample (kept as is when it already names one)."""
        if self.sample is not None:
            return self
        return type(self)(self.reward, self.reason, self.completion, sample, example)


def _edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions and adjacent swaps cost 1."""
    d = [[max(i, j) if min(i, j) == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest candidates, or an empty string when none is close.

    Case is ignored; a candidate the word is a prefix of ranks first (``freeze_vision`` ->
    ``freeze_vision_encoder``), then small edit distances (swaps count once: ``gpro`` -> ``grpo``),
    then difflib's similarity.
    """
    pool = [c for c in dict.fromkeys(candidates) if c != word]
    low = word.lower()
    ranked = [c for c in pool if c.lower() == low]
    ranked += [c for c in pool if c not in ranked and len(low) >= 3 and c.lower().startswith(low)]
    budget = max(1, len(word) // 4)
    near = sorted((d, c) for c in pool if c not in ranked and (d := _edit_distance(low, c.lower())) <= budget)
    ranked += [c for _, c in near]
    ranked += [c for c in difflib.get_close_matches(word, pool, n=3, cutoff=0.75) if c not in ranked]
    close = ranked[:3]
    if not close:
        return ""
    if len(close) == 1:
        return f" Did you mean {close[0]!r}?"
    return " Did you mean " + ", ".join(repr(c) for c in close[:-1]) + f" or {close[-1]!r}?"
