"""The OpenAI chat-completions request, parsed strictly, and the response built from what the model answered.

Every problem is a `RequestError` naming the field (``messages[0].content[1].image_url``), which the server
answers as an OpenAI-style error. Images are decoded while parsing, in the connection's thread, with the run's
`ImageLimits` (``data:`` URIs; ``http(s)`` only when the config allows it; never a file path), so a bad image
is a 400 before anything reaches the model's queue; the messages, images and videos are parsed by
`vlmreg.serve.messages` (`parse_messages`).

What the official ``openai`` client sends is understood as OpenAI defines it (docs/serving.md has the table):
``stop`` strings, ``logit_bias``, frequency and presence penalties, ``top_logprobs``, ``response_format``
``text``, ``stream`` (see `vlmreg.serve.streaming`), the ``developer`` role and assistant ``content: null``.
What cannot be honoured (JSON modes, tools) is refused with a 400 naming the field, never ignored.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from vlmreg.data.images import ImageLimits
from vlmreg.sdk.errors import RequestError  # RequestError lives in the SDK: a plugin's receiver raises it
from vlmreg.serve.messages import EMPTY_MESSAGE_FIELDS, ROLES, parse_messages
from vlmreg.serve.video_frames import media_io_video

__all__ = [
    "EMPTY_MESSAGE_FIELDS",
    "ROLES",
    "Answer",
    "ChatRequest",
    "Choice",
    "RequestError",
    "ServeLimits",
    "chat_response",
    "logprob_entries",
    "parse_chat_request",
    "parse_messages",
    "usage",
]

SUPPORTED_FIELDS = (
    "model",
    "messages",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "logprobs",
    "top_logprobs",
    "stop",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "response_format",
    "stream",
    "stream_options",
    "user",
    "return_token_ids",
    "chat_template_kwargs",
    "stop_token_ids",
    "thinking_token_budget",
    "media_io_kwargs",
)
MAX_STOPS = 4  # as OpenAI: up to four stop strings
MAX_TOP_LOGPROBS = 20
SEED_RANGE = (-(2**63), 2**63 - 1)  # vLLM's: a 64-bit signed integer (torch.iinfo(torch.long))
MIN_TEMPERATURE = 0.01  # vLLM's smallest sampling temperature (_MAX_TEMP): below it, inf and nan in the probabilities
# apply_chat_template's own arguments: a template variable of these names would clash with how vlmreg calls it.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "chat_template",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
    }
)


@attrs.frozen
class ServeLimits:
    """What the server accepts: its model's name, the defaults it fills in and the bounds it enforces."""

    model_name: str
    max_tokens: int  # default when a request names none
    max_n: int  # the batch size: more choices than one batch holds are refused
    max_images_per_message: int
    images: ImageLimits
    vocab_size: int | None = None  # the model's logits: logit_bias token ids must be below it
    family: str = ""  # the served model's family, named when a request asks for what it lacks
    thinking_markers: bool = False  # the family declares thinking_start and thinking_end: a thinking budget applies
    max_videos_per_message: int = 0  # 0: the family takes no video, and a video_url part is refused naming it
    videos: Any = None  # `vlmreg.data.video.VideoLimits` (None: the defaults over ``images``)
    video_sampling: Any = None  # the `VideoSampling` applied to every video (None: `DEFAULT_VIDEO_SAMPLING`)


@attrs.frozen(eq=False)
class ChatRequest:
    """One parsed request. ``messages`` are vlmreg messages whose image parts hold decoded PIL images."""

    messages: list[dict[str, Any]]
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    logprobs: bool = False
    return_token_ids: bool = False
    stop_token_ids: tuple[int, ...] = ()
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # sorted by token id
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    # end the thinking after this many thinking tokens (`vlmreg.inference.thinking`)
    thinking_token_budget: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@attrs.frozen
class Choice:
    """One sampled completion: token ids (a stop token included; with stop strings, every token sampled up to
    the one that completed the stop string), the logprob of each under the sampling distribution, each token's
    text and exact bytes, the answer (cut before a stop string) and why it ended (``stop`` or ``length``).

    ``top`` holds each token's alternatives ``(text, logprob, bytes)`` when ``top_logprobs`` was asked for;
    ``pieces`` the text each token adds to the answer, for a stream.
    """

    token_ids: list[int]
    logprobs: list[float]
    tokens: list[str]
    text: str
    finish_reason: str
    token_bytes: list[bytes] = attrs.field(factory=list)
    top: list[list[tuple[str, float, bytes]]] = attrs.field(factory=list)
    pieces: list[str] = attrs.field(factory=list)


@attrs.frozen
class Answer:
    """What the model made of one request: the exact prompt token ids it saw, and one `Choice` per ``n``."""

    prompt_token_ids: list[int]
    choices: list[Choice]


# -- parsing ------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(body: Mapping[str, Any], key: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if not _is_int(value):
        raise RequestError(key, f"must be an integer (got {value!r})")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise RequestError(key, f"must be {bound} (got {value})")
    return value


def _number(body: Mapping[str, Any], key: str, default: float, ok: Any, rule: str) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not _is_number(value) or not ok(value):
        raise RequestError(key, f"must be a number {rule} (got {value!r})")
    return float(value)


def _bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(key, f"must be true or false (got {value!r})")
    return value


def _template_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RequestError("chat_template_kwargs", "must be an object")
    clash = sorted(RESERVED_TEMPLATE_KWARGS & set(value))
    if clash:
        raise RequestError(
            f"chat_template_kwargs.{clash[0]}", "is set by the server and may not be passed to the chat template"
        )
    return dict(value)


def _check_unsupported(body: Mapping[str, Any]) -> None:
    unknown = sorted(set(body) - set(SUPPORTED_FIELDS))
    if unknown:
        raise RequestError(unknown[0], f"unsupported field (supported: {', '.join(SUPPORTED_FIELDS)})")
    if body.get("top_k") not in (None, 0, -1):
        raise RequestError(
            "top_k", f"only -1 or 0 (no top-k cut, so logprobs are the policy's) is supported (got {body['top_k']!r})"
        )
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError("user", "must be a string")


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop", f"must be a string or a list of up to {MAX_STOPS} strings (got {value!r})")
    if len(stops) > MAX_STOPS:
        raise RequestError("stop", f"takes at most {MAX_STOPS} strings (got {len(stops)})")
    if any(s == "" for s in stops):
        raise RequestError("stop", "an empty stop string would end every completion at once")
    return tuple(dict.fromkeys(stops))


def _logit_bias(value: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise RequestError("logit_bias", 'must be an object mapping token ids to biases, e.g. {"42": -100}')
    out = {}
    for key, bias in value.items():
        where = f"logit_bias.{key}"
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
        if token is None:
            raise RequestError(where, "keys must be token ids written as decimal strings")
        if vocab_size is not None and token >= vocab_size:
            raise RequestError(where, f"token id {token} is outside the model's vocabulary of {vocab_size}")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise RequestError(where, f"the bias must be a number between -100 and 100 (got {bias!r})")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _stop_token_ids(value: Any, vocab_size: int | None) -> list[int]:
    """Token ids in the model's vocabulary (vLLM checks them so too), duplicates dropped."""
    stops = value or []
    if not isinstance(stops, list) or not all(_is_int(t) and t >= 0 for t in stops):
        raise RequestError("stop_token_ids", f"must be a list of token ids (got {stops!r})")
    for i, token in enumerate(stops):
        if vocab_size is not None and token >= vocab_size:
            raise RequestError(
                f"stop_token_ids[{i}]", f"token id {token} is outside the model's vocabulary of {vocab_size}"
            )
    return list(dict.fromkeys(stops))


def _thinking_token_budget(value: Any, limits: ServeLimits) -> int | None:
    """vLLM's rule (an integer >= 0; -1 or null: no budget), and the family must have the markers to end thinking
    with."""
    if value is None or (_is_int(value) and value == -1):
        return None
    if not _is_int(value) or value < 0:
        raise RequestError("thinking_token_budget", f"must be an integer >= 0, or -1 for no budget (got {value!r})")
    if not limits.thinking_markers:
        raise RequestError(
            "thinking_token_budget",
            f"the served model's family ({limits.family or 'unknown'}) declares no thinking markers "
            "(thinking_start, thinking_end), so this server cannot end a thinking block; leave it unset",
        )
    return value


def _response_format(value: Any) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return
    if kind in ("json_object", "json_schema"):
        raise RequestError(
            "response_format",
            f'{kind} is not supported: this server has no constrained decoding; use {{"type": "text"}}',
        )
    raise RequestError("response_format", f'must be {{"type": "text"}} (got {value!r})')


def _include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise RequestError("stream_options", "is only allowed with stream: true")
    if not isinstance(options, Mapping):
        raise RequestError("stream_options", "must be an object")
    unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})
    if unknown:
        raise RequestError(
            f"stream_options.{unknown[0]}", "unsupported (supported: include_usage, include_obfuscation)"
        )
    for key in options:
        if options[key] is not None and not isinstance(options[key], bool):
            raise RequestError(f"stream_options.{key}", f"must be true or false (got {options[key]!r})")
    return bool(options.get("include_usage"))


def parse_chat_request(body: Any, limits: ServeLimits) -> ChatRequest:
    """A `ChatRequest` from a decoded JSON body, or a `RequestError` naming the first bad field."""
    if not isinstance(body, Mapping):
        raise RequestError(None, f"the body must be a JSON object (got {type(body).__name__})")
    _check_unsupported(body)
    model = body.get("model")
    if model is not None and model != limits.model_name:
        raise RequestError(
            "model",
            f"the model {model!r} does not exist; this server serves {limits.model_name!r}",
            status=404,
            code="model_not_found",
        )
    max_tokens = _int(body, "max_tokens", None, 1)
    max_completion = _int(body, "max_completion_tokens", None, 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise RequestError(
            "max_completion_tokens", f"differs from max_tokens ({max_completion} != {max_tokens}); set one of them"
        )
    stops = _stop_token_ids(body.get("stop_token_ids"), limits.vocab_size)
    seed = _int(body, "seed", None, *SEED_RANGE)
    n = _int(body, "n", 1, 1, limits.max_n)
    assert n is not None
    logprobs = _bool(body, "logprobs")
    top_logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise RequestError("top_logprobs", "needs logprobs: true")
    _response_format(body.get("response_format"))
    stream = _bool(body, "stream")
    penalty = "between -2 and 2 (OpenAI's range)"
    return ChatRequest(
        messages=parse_messages(body.get("messages"), limits, media_io_video(body.get("media_io_kwargs"))),
        n=n,
        temperature=_number(
            body,
            "temperature",
            1.0,
            lambda v: v == 0 or MIN_TEMPERATURE <= v < float("inf"),
            f"0 (greedy) or from {MIN_TEMPERATURE} (vLLM's smallest), finite",
        ),
        top_p=_number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        max_tokens=max_tokens or max_completion or limits.max_tokens,
        seed=seed,
        logprobs=logprobs,
        return_token_ids=_bool(body, "return_token_ids"),
        stop_token_ids=tuple(stops),
        template_kwargs=_template_kwargs(body.get("chat_template_kwargs")),
        stop=_stops(body.get("stop")),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, lambda v: -2 <= v <= 2, penalty),
        presence_penalty=_number(body, "presence_penalty", 0.0, lambda v: -2 <= v <= 2, penalty),
        logit_bias=_logit_bias(body.get("logit_bias"), limits.vocab_size),
        top_logprobs=top_logprobs or 0,
        stream=stream,
        include_usage=_include_usage(body, stream),
        thinking_token_budget=_thinking_token_budget(body.get("thinking_token_budget"), limits),
    )


# -- the response -------------------------------------------------------------------------------
def logprob_entries(choice: Choice, start: int = 0, stop: int | None = None) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content`` entries for the choice's tokens ``start:stop``."""
    stop = len(choice.token_ids) if stop is None else stop
    out = []
    for i in range(start, stop):
        top = choice.top[i] if choice.top else []
        out.append(
            {
                "token": choice.tokens[i],
                "logprob": choice.logprobs[i],
                "bytes": list(choice.token_bytes[i]) if choice.token_bytes else list(choice.tokens[i].encode()),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, lp, b in top],
            }
        )
    return out


def _choice(index: int, choice: Choice, request: ChatRequest) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": index,
        "message": {"role": "assistant", "content": choice.text},
        "finish_reason": choice.finish_reason,
        "logprobs": None,
    }
    if request.logprobs:
        out["logprobs"] = {"content": logprob_entries(choice)}
    if request.return_token_ids:
        out["token_ids"] = choice.token_ids
    return out


def usage(answer: Answer) -> dict[str, int]:
    """Token counts: the prompt once, and every sampled token of every choice."""
    completion_tokens = sum(len(c.token_ids) for c in answer.choices)
    prompt_tokens = len(answer.prompt_token_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_response(request: ChatRequest, answer: Answer, model_name: str) -> dict[str, Any]:
    """The OpenAI ``chat.completion`` object, plus ``prompt_token_ids`` / ``token_ids`` when asked for."""
    out: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [_choice(i, c, request) for i, c in enumerate(answer.choices)],
        "usage": usage(answer),
    }
    if request.return_token_ids:
        out["prompt_token_ids"] = answer.prompt_token_ids
    return out
