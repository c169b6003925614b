"""The rollout engine protocol: prompts (token ids + image ids) in, completions with their logprobs out.

``logprobs`` are those of the distribution each token was really sampled from (after temperature and
top-p), so the trainer can correct for any mismatch with truncated importance sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

__all__ = ["Completion", "PromptRequest", "RolloutEngine", "SamplingParams"]


@attrs.frozen
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    suppress_token_ids: tuple[int, ...] = ()
    greedy: bool = False


@attrs.frozen
class PromptRequest:
    """One prompt: its token ids (image tokens expanded) and the ids of its images, in token order."""

    input_ids: list[int]
    image_ids: list[str]


@attrs.frozen
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token, included) or "length"


class RolloutEngine(Protocol):
    def generate(self, requests: Sequence[PromptRequest], params: SamplingParams) -> list[Completion]:
        """One completion per request, in order."""
        ...
