"""The rollout engine protocol: conversations in, prompt tokens + completion tokens and logprobs out.

An engine renders each conversation (chat template, images by id from the run's `ImageStore`), samples a
completion and returns the exact prompt token ids it used, so training samples are built from the tokens
the policy really saw. ``logprobs`` are those of the distribution each token was really sampled from (after
temperature and top-p), so the trainer can correct any mismatch with truncated importance sampling.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from vlmreg.data.prompts import EncodedPrompt

__all__ = ["ChatTurn", "Completion", "PromptRequest", "RolloutEngine", "SamplingParams"]


@attrs.frozen
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    suppress_token_ids: tuple[int, ...] = ()
    greedy: bool = False
    #: end the thinking after this many thinking tokens, the prompt's own after the start marker counted
    #: (`vlmreg.rollout.thinking`); ``None``: no budget
    thinking_budget: int | None = None


@attrs.frozen
class PromptRequest:
    """One prompt: its token ids (image expansions spliced in), its images in token order, and each image's span."""

    input_ids: list[int]
    image_ids: list[str]
    image_spans: list[tuple[int, int]]

    @classmethod
    def of(cls, prompt: EncodedPrompt) -> PromptRequest:
        return cls(prompt.input_ids, prompt.image_ids, prompt.image_spans)


@attrs.frozen
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token, included) or "length"
    thinking_forced: bool = False  # the thinking budget ended this completion's thinking (its end marker was forced)


@attrs.frozen
class ChatTurn:
    """One conversation's turn: the prompt as the engine encoded it, the completion, and its decoded text."""

    prompt: EncodedPrompt
    completion: Completion
    text: str


class RolloutEngine(Protocol):
    """Samples completions. An engine that also has ``complete(prompts, params)`` and an ``encoder``
    (`PromptEncoder`) takes token prompts, and the episode runner continues conversations from the sampled
    tokens; otherwise each turn's conversation is sent as messages and the engine renders it."""

    def chat(
        self,
        conversations: Sequence[Sequence[Mapping[str, Any]]],
        params: SamplingParams,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        names: Sequence[str] | None = None,
    ) -> list[ChatTurn]:
        """One completion per conversation, in order. ``names`` identify the conversations in error messages."""
        ...
