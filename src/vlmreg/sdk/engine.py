"""`Engine`: a rollout engine registered by name through ``vlmreg_register_rollout_engines``, and the rollout engine
protocol: conversations in, prompt tokens + completion tokens and logprobs out.

``[rollout] engine`` names one. ``build(context)`` receives an `EngineContext` (the run's config, model, processor,
image store, device and family; for a server engine also the server's URL and API key) and returns an object with
the rollout engine protocol (`RolloutEngine`: ``chat(conversations, params, template_kwargs=None, names=None) ->
list[ChatTurn]``). A ``server`` engine samples from a server that runs apart: the
trainer launches or attaches to it (``[rollout] launch`` / ``url``) and syncs its weights (``[broadcast] transport``).
A ``thinking_budget`` engine applies ``SamplingParams.thinking_budget`` (`vlmreg.inference.thinking`) and reports the
completions it cut (``Completion.thinking_forced``); ``[rollout] thinking_budget`` is refused for any other.

An engine renders each conversation (chat template, images by id from the run's `ImageStore`), samples a completion
and returns the exact prompt token ids it used (`EncodedPrompt`), so training samples are built from the tokens the
policy really saw. ``logprobs`` are those of the distribution each token was really sampled from (after temperature
and top-p), so the trainer can correct any mismatch with truncated importance sampling. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from vlmreg.sdk.field_checks import check_bool, check_callable, check_name

__all__ = [
    "ChatTurn",
    "Completion",
    "EncodedPrompt",
    "Engine",
    "EngineContext",
    "PromptRequest",
    "RolloutEngine",
    "SamplingParams",
]


@attrs.frozen(kw_only=True, eq=False)
class Engine:
    """A rollout engine: ``build(context) -> engine``; ``server``: whether it samples from a server apart;
    ``thinking_budget``: whether it ends the thinking after ``SamplingParams.thinking_budget`` thinking tokens."""

    name: str = attrs.field(validator=check_name)
    build: Callable[[Any], Any] = attrs.field(
        validator=check_callable(optional=False, what="a callable taking an EngineContext")
    )
    server: bool = attrs.field(default=False, validator=check_bool)
    thinking_budget: bool = attrs.field(default=False, validator=check_bool)
    description: str = ""


@attrs.frozen(kw_only=True)
class EngineContext:
    """What an engine's ``build`` gets: the run (``rc``: its `ResolvedConfig`), the model being trained, its processor,
    the run's image store, the device, the family's descriptor, the output directory, and for a server engine the
    server's ``url`` and ``api_key``, and for vLLM its ``cache_scope`` (`vlmreg.inference.cache_scope.CacheScope`): an
    engine that puts it on its requests sets ``cache_scope.applied``, else the server's caches are cleared every
    sync."""

    rc: Any
    model: Any
    processor: Any
    store: Any
    device: Any
    descriptor: Any
    output_dir: Path
    url: str | None = None
    api_key: str | None = None
    cache_scope: Any = None


@attrs.frozen
class EncodedPrompt:
    """Token ids of a rendered conversation, its images in token order, and the span of ids each image owns."""

    input_ids: list[int]
    image_ids: list[str]
    image_spans: list[tuple[int, int]]
    text: str

    @property
    def image_tokens(self) -> list[int]:
        """How many tokens each image takes."""
        return [end - start for start, end in self.image_spans]


@attrs.frozen
class SamplingParams:
    """How to sample one batch: temperature, top-p, the token budget, stop ids (kept in the completion), ids never
    sampled (``suppress_token_ids``), greedy decoding, and the thinking budget."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    suppress_token_ids: tuple[int, ...] = ()
    greedy: bool = False
    #: end the thinking after this many thinking tokens, the prompt's own after the start marker counted
    #: (`vlmreg.inference.thinking`); ``None``: no budget
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


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@attrs.frozen
class Completion:
    """The sampled tokens and the logprob each was sampled with (one per token), and why sampling ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token, included) or "length"
    thinking_forced: bool = False  # the thinking budget ended this completion's thinking (its end marker was forced)
    #: positions in ``token_ids`` the engine wrote itself (the end marker a thinking budget forced): not the policy's
    #: samples, so the trainer keeps them out of the loss and of ``mismatch_kl``
    forced: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)


@attrs.frozen
class ChatTurn:
    """One conversation's turn: the prompt as the engine encoded it, the completion, and its decoded text."""

    prompt: EncodedPrompt
    completion: Completion
    text: str


class RolloutEngine(Protocol):
    """Samples completions. An engine that also has ``complete(prompts, params)`` and an ``encoder``
    (`vlmreg.data.prompts.PromptEncoder`) takes token prompts, and the episode runner continues conversations from the
    sampled tokens; otherwise each turn's conversation is sent as messages and the engine renders it."""

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
