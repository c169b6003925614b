"""`OpenAIEngine`: a rollout engine that samples from an OpenAI-compatible server (vlmreg serve, vLLM).

Conversations of one `chat` call whose requests would be identical (a GRPO group's: the same messages and sampling
settings) go as ONE request with ``n`` = their count (``[rollout] share_prompts``, at most ``max_concurrent_rollouts``
a request): the server renders the prompt and encodes the images once, and its choices come back in the callers'
order, each the turn its own request would have given. Any other conversation is one request with ``n = 1``. Images
are sent as PNG data URIs (lossless, so the server sees the very pixels of the trainer's `ImageStore`), with
``logprobs`` and ``return_token_ids`` on: the trainer builds samples from the server's exact prompt and completion
token ids, never from re-tokenized text. The server's prompt is checked against the trainer's processor: its image
tokens must number what the local processor gives the same images, or the two disagree and training would misalign
features.

Videos go as the trainer's own frames and timing (`vlmreg.inference.video_request`), and a video conversation's prompt
must come back as the trainer's own encoding of it, token for token.

A thinking budget (``SamplingParams.thinking_budget``) travels as ``thinking_token_budget``, the field vLLM and
``vlmreg serve`` both take; a completion whose thinking it ended is found in the returned ids by
`vlmreg.inference.thinking.forced_markers` (``Completion.thinking_forced``, and every forced marker's positions in
``Completion.forced``).

Requests run on a thread pool, at most ``max_concurrent`` completions in flight (a request of ``n`` counts ``n``), and
go through `vlmreg.http.client.JsonClient`: connection failures and 5xx answers are retried with exponential backoff
(a shared request as a whole), a 4xx or a timeout is not; the final error names the URL and the conversation(s).
"""

from __future__ import annotations

import base64
import io
import json
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from vlmreg.data.prompts import PromptEncoder, template_messages
from vlmreg.data.store import ImageStore, is_video_id
from vlmreg.http.client import AnswerError, HttpError, HttpStatusError, JsonClient, field
from vlmreg.inference.thinking import forced_marker_positions, forced_markers, thinking_markers, vllm_reasoning_config
from vlmreg.inference.video_request import (
    prompt_difference,
    video_media_io_kwargs,
    video_parts,
)
from vlmreg.sdk.engine import ChatTurn, Completion, EncodedPrompt, SamplingParams
from vlmreg.sdk.errors import VlmregError

if TYPE_CHECKING:
    from vlmreg.config.schema import RolloutSection

__all__ = ["OpenAIEngine", "RolloutServerError"]


class RolloutServerError(VlmregError):
    """The inference server failed a request for good, or answered something the trainer cannot use."""


def base_url(url: str) -> str:
    """A server's base URL: ``http://host:8000/v1/`` and ``http://host:8000`` both give ``http://host:8000``,
    so the OpenAI routes (``/v1/...``) and a server's own (``/collective_rpc``, ``/health``) are found from either."""
    return url.rstrip("/").removesuffix("/v1")


def png_data_uri(image: Any) -> str:
    """A PIL image as a lossless ``data:image/png;base64,...`` URI."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class _CompletionSlots:
    """At most ``size`` completions in flight: a request of ``n`` takes ``n`` slots (``n <= size``) until it is
    answered."""

    def __init__(self, size: int) -> None:
        self.free, self._cond = size, threading.Condition()

    def run(self, n: int, fn: Any, *args: Any) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: self.free >= n)
            self.free -= n
        try:
            return fn(*args)
        finally:
            with self._cond:
                self.free += n
                self._cond.notify_all()


def _label(names: Sequence[str], indices: Sequence[int]) -> str:
    """How errors name the conversations of one request: one name, or the group's (``ex:3 (n = 8)``)."""
    if len(indices) == 1:
        return names[indices[0]]
    distinct = list(dict.fromkeys(names[i] for i in indices))
    shown = ", ".join(distinct[:3]) + (f" and {len(distinct) - 3} more" if len(distinct) > 3 else "")
    return f"{shown} (n = {len(indices)})"


_MEDIA_PARTS = ("image_url", "video_url")


def _share_key(payload: Mapping[str, Any], image_of: Mapping[str, str]) -> str:
    """The payload as a string, each image's or video's data URI written as its number in ``image_of`` (one per
    distinct URI), so equal keys are equal payloads and megabytes of base64 are not serialized once per conversation
    to compare them."""
    messages = []
    for message in payload["messages"]:
        content = message["content"]
        if not isinstance(content, str):
            content = [
                {
                    **part,
                    kind: {**part[kind], "url": "media:" + image_of.get(part[kind]["url"], part[kind]["url"])},
                }
                if (kind := part.get("type")) in _MEDIA_PARTS
                else part
                for part in content
            ]
        messages.append({**message, "content": content})
    return json.dumps({**payload, "messages": messages}, sort_keys=True)


class OpenAIEngine:
    """Samples each conversation from an OpenAI-compatible server that returns token ids and logprobs.

    ``url`` is the server's base URL (``http://host:8000``; a trailing ``/v1`` is accepted). ``model``
    defaults to the first one ``GET /v1/models`` lists. ``processor`` and ``store`` are the trainer's. ``api_key``,
    when given, is sent on every request as ``Authorization: Bearer KEY``. ``share_prompts``: identical conversations
    of one call go as one request with ``n`` = their count (at most ``max_concurrent``); ``False``: one request each,
    for a server that does not honour ``n`` with token ids and logprobs. ``server``: which server it is (``"vllm"``
    or ``"vlmreg"``, `RolloutSection.server`): what vLLM's video expansion lacks is sent to vLLM only.
    """

    def __init__(
        self,
        url: str,
        processor: Any,
        store: ImageStore,
        *,
        model: str | None = None,
        max_concurrent: int = 64,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        descriptor: Any = None,
        api_key: str | None = None,
        cache_scope: Any = None,
        share_prompts: bool = True,
        server: str = "vlmreg",
    ) -> None:
        self.url = base_url(url)
        self.server = server
        self.share_prompts = share_prompts
        # vLLM under the trainer: every request scoped to the weights it holds (`vlmreg.inference.cache_scope`)
        self.cache_scope = cache_scope
        if cache_scope is not None:
            cache_scope.applied = True
        self.api_key = api_key
        self.processor, self.store, self.model, self.descriptor = processor, store, model, descriptor
        self._prompts: PromptEncoder | None = None
        # the family's thinking markers' ids, once a budget asks
        self._markers: tuple[list[int], list[int]] | None = None
        self.max_concurrent, self.timeout_s = max_concurrent, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.client = JsonClient(
            self.url,
            api_key=api_key,
            timeout_s=timeout_s,
            retries=max_retries,
            backoff_s=backoff_s,
            timeout_setting="rollout.request_timeout_s",
        )

    @classmethod
    def from_config(
        cls,
        rollout: RolloutSection,
        processor: Any,
        store: ImageStore,
        descriptor: Any = None,
        *,
        url: str | None = None,
        api_key: str | None = None,
        cache_scope: Any = None,
    ) -> OpenAIEngine:
        """The engine a ``[rollout]`` section with ``engine = "openai"`` describes; ``url`` and ``api_key`` (a launched
        server's) replace ``rollout.url`` and the ``VLMREG_API_KEY`` environment variable; ``cache_scope``: a vLLM
        server's (`vlmreg.inference.cache_scope.CacheScope`), put on every request."""
        url = url or (rollout.urls[0] if rollout.urls else None)
        if url is None:
            raise VlmregError("rollout.url is not set: the OpenAI engine needs the server's base URL")
        return cls(
            url,
            processor,
            store,
            max_concurrent=rollout.max_concurrent_rollouts,
            timeout_s=rollout.request_timeout_s,
            max_retries=rollout.max_retries,
            descriptor=descriptor,
            api_key=api_key or os.environ.get("VLMREG_API_KEY") or None,  # the key of a server that checks one
            cache_scope=cache_scope,
            share_prompts=rollout.share_prompts,
            server=rollout.server,
        )

    @property
    def prompts(self) -> PromptEncoder:
        """The trainer's prompt encoder: what the trainer's processor makes of each image."""
        if self._prompts is None:
            self._prompts = PromptEncoder(self.processor, self.store, self.descriptor)
        return self._prompts

    # -- the engine protocol ------------------------------------------------------------------------
    def chat(
        self,
        conversations: Sequence[Sequence[Mapping[str, Any]]],
        params: SamplingParams,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        names: Sequence[str] | None = None,
    ) -> list[ChatTurn]:
        """One completion per conversation, in order. Identical requests (a GRPO group's) are sent as one with ``n`` =
        their count when ``share_prompts`` is on; at most ``max_concurrent`` completions are in flight."""
        if not conversations:
            return []
        names = list(names or [f"conversation {i}" for i in range(len(conversations))])
        if params.thinking_budget is not None and self._markers is None:
            self._markers = thinking_markers(self.prompts.tokenizer, self.descriptor)
            if self._markers is None:
                raise VlmregError(
                    "rollout.thinking_budget: the family declares no thinking markers (thinking_start, thinking_end)"
                )
        model = self.model or self._first_model()
        uris: dict[str, str] = {}  # the same image in many conversations (a GRPO group) is encoded once
        payloads = [self._payload(c, params, template_kwargs, model, uris) for c in conversations]
        requests = self._requests(payloads)
        slots = _CompletionSlots(self.max_concurrent)
        pool = ThreadPoolExecutor(min(self.max_concurrent, len(requests)), thread_name_prefix="vlmreg-openai")
        futures = [
            pool.submit(
                slots.run,
                len(indices),
                self._post_with_retries,
                "/v1/chat/completions",
                payload,
                _label(names, indices),
            )
            for payload, indices in requests
        ]
        try:
            bodies = [f.result() for f in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        turns: list[ChatTurn | None] = [None] * len(conversations)
        for (_, indices), body in zip(requests, bodies, strict=True):
            answered = self._turns(
                conversations[indices[0]],
                body,
                _label(names, indices),
                len(indices),
                params.thinking_budget,
                template_kwargs,
            )
            for index, turn in zip(indices, answered, strict=True):
                turns[index] = turn
        return [turn for turn in turns if turn is not None]

    def _requests(self, payloads: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[int]]]:
        """The requests that carry ``payloads``: identical ones shared (``n`` = their count, at most ``max_concurrent``)
        when ``share_prompts`` is on, each with the indices of its conversations, in the order of their first."""
        if not self.share_prompts:
            return [(payload, [index]) for index, payload in enumerate(payloads)]
        image_of: dict[str, str] = {}
        for payload in payloads:
            for message in payload["messages"]:
                for part in message["content"] if not isinstance(message["content"], str) else ():
                    # the data URI strings are shared, so their hashes are computed once
                    if (kind := part.get("type")) in _MEDIA_PARTS:
                        image_of.setdefault(part[kind]["url"], str(len(image_of)))
        groups: dict[str, list[int]] = {}
        for index, payload in enumerate(payloads):
            groups.setdefault(_share_key(payload, image_of), []).append(index)
        requests = []
        for indices in groups.values():
            for start in range(0, len(indices), self.max_concurrent):
                chunk = indices[start : start + self.max_concurrent]
                requests.append(({**payloads[chunk[0]], "n": len(chunk)}, chunk))
        return requests

    def answer(
        self, conversation: Sequence[Mapping[str, Any]], params: SamplingParams, *, name: str = "conversation"
    ) -> Any:
        """The server's JSON answer to one conversation, unparsed, for the request `chat` sends it alone (``n = 1``; for
        checks that compare the server's prompt ids with references themselves, `vlmreg.testing.engine_parity`)."""
        model = self.model or self._first_model()
        return self._post_with_retries(
            "/v1/chat/completions", self._payload(conversation, params, None, model, {}), name
        )

    # -- requests ------------------------------------------------------------------------------
    def _payload(
        self,
        conversation: Sequence[Mapping[str, Any]],
        params: SamplingParams,
        template_kwargs: Mapping[str, Any] | None,
        model: str,
        uris: dict[str, str],
    ) -> dict[str, Any]:
        messages = []
        scope = self.cache_scope
        timings: list[tuple[int, float, tuple[int, ...], int]] = []
        for message in conversation:
            content = message["content"]
            if not isinstance(content, str):
                parts = []
                for part in content:
                    if part.get("type") == "image":
                        image_id = part["image"]
                        if image_id not in uris:
                            image = self.store.get(image_id)
                            hook = getattr(self.descriptor, "engine_image", None)
                            uris[image_id] = png_data_uri(hook(self.processor, image) if hook is not None else image)
                        part = {"type": "image_url", "image_url": {"url": uris[image_id]}}
                        if scope is not None:
                            part["uuid"] = scope.image_uuid(image_id)
                        parts.append(part)
                    elif part.get("type") == "video":
                        parts += video_parts(self.server, self.store, part["video"], self, uris, timings, scope)
                    else:
                        parts.append(dict(part))
                content = parts
            messages.append({"role": message["role"], "content": content})
        payload: dict[str, Any] = {
            "model": scope.model if scope is not None and scope.model else model,  # vLLM: this version's LoRA adapter
            "messages": messages,
            "n": 1,
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": 1.0 if params.greedy else params.top_p,
            "top_k": -1,  # no top-k cut: a server default of top_k would make the logprobs not the policy's
            "max_tokens": params.max_tokens,
            "logprobs": True,
            "return_token_ids": True,
        }
        if params.stop_token_ids:
            payload["stop_token_ids"] = list(params.stop_token_ids)
        # the family's vision tokens: no probability on the server either, as in the trainer
        if params.suppress_token_ids:
            payload["logit_bias"] = {str(i): -100 for i in params.suppress_token_ids}
        if template_kwargs:
            payload["chat_template_kwargs"] = dict(template_kwargs)
        if params.thinking_budget is not None:  # vLLM's name (a SamplingParams field); vlmreg serve takes it too
            payload["thinking_token_budget"] = params.thinking_budget
        if scope is not None:
            payload["cache_salt"] = scope.salt
        if timings:
            payload["media_io_kwargs"] = video_media_io_kwargs(timings, "a video conversation")
        return payload

    def _first_model(self) -> str:
        body = self._post_with_retries("/v1/models", None, "GET /v1/models")
        try:
            self.model = str(field(body, "data.0.id", str, f"{self.url}/v1/models"))
        except AnswerError as exc:
            raise RolloutServerError(f"{exc} (it lists no model); set the model name explicitly") from None
        return self.model

    def _post_with_retries(self, path: str, payload: dict[str, Any] | None, name: str) -> Any:
        """POST ``payload`` (GET when ``None``) and decode the JSON answer, retrying what may pass
        (`vlmreg.http.client`)."""
        try:
            return self.client.request("GET" if payload is None else "POST", path, payload)
        except HttpError as exc:
            hint = ""
            flag = vllm_reasoning_config(self.descriptor)
            if isinstance(exc, HttpStatusError) and "reasoning_config" in exc.server_message and flag is not None:
                # a vLLM started without the markers
                hint = f" (start that vLLM with --reasoning-config '{flag}' for rollout.thinking_budget)"
            raise RolloutServerError(f"{exc.url} failed for {name}: {exc.detail}{hint}") from None

    # -- answers -------------------------------------------------------------------------------
    def _turns(
        self,
        conversation: Sequence[Mapping[str, Any]],
        body: Any,
        name: str,
        n: int,
        budget: int | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[ChatTurn]:
        """The turns of an answer to ``n`` completions of ``conversation``, in the order of the choices' ``index``."""
        where = f"{self.url}: {name}"
        lacks = "the server must support return_token_ids and logprobs (vlmreg serve; a vLLM with return_token_ids)"
        try:
            prompt_ids = [int(t) for t in body["prompt_token_ids"]]
            choices = list(body["choices"])
        except (KeyError, TypeError, ValueError) as exc:
            raise RolloutServerError(f"{where}: the answer lacks {exc}: {lacks}") from None
        honour = "a server that does not honour n: set [rollout] share_prompts = false"
        if len(choices) != n:
            raise RolloutServerError(
                f"{where}: asked for n = {n} completions, the answer holds {len(choices)} choice(s) ({honour})"
            )
        try:
            order = [0] if n == 1 and "index" not in choices[0] else [int(choice["index"]) for choice in choices]
        except (KeyError, TypeError, ValueError) as exc:
            raise RolloutServerError(
                f"{where}: a choice of the n = {n} lacks a valid index ({exc}) ({honour})"
            ) from None
        if sorted(order) != list(range(n)):
            raise RolloutServerError(
                f"{where}: the n = {n} choices' index values are {order}, not 0 to {n - 1} once each ({honour})"
            )
        _, image_ids = template_messages(conversation)
        tokenizer = self.prompts.tokenizer
        if any(is_video_id(i) for i in image_ids):  # the trainer's own encoding, which the server's prompt must be
            mine = self._check_video_prompt(conversation, prompt_ids, template_kwargs, where)
            spans, text = list(mine.image_spans), mine.text
        else:
            spans = self._image_spans(prompt_ids, image_ids, where)
            pieces, at = [], 0
            for start, end in spans:  # each image's expansion shown as the placeholder, as the template renders it
                pieces += [tokenizer.decode(prompt_ids[at:start]), self.prompts.placeholder]
                at = end
            text = "".join([*pieces, tokenizer.decode(prompt_ids[at:])])
        turns: list[ChatTurn | None] = [None] * n
        for index, choice in zip(order, choices, strict=True):
            try:
                token_ids = [int(t) for t in choice["token_ids"]]
                logprobs = [float(entry["logprob"]) for entry in choice["logprobs"]["content"]]
                reason = choice["finish_reason"]
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise RolloutServerError(f"{where}: the answer lacks {exc}: {lacks}") from None
            at_fault = where if n == 1 else f"{where}, choice {index}"
            if len(logprobs) != len(token_ids):
                raise RolloutServerError(
                    f"{at_fault}: {len(token_ids)} completion token ids but {len(logprobs)} logprobs"
                )
            if reason not in ("stop", "length"):
                raise RolloutServerError(f"{at_fault}: finish_reason {reason!r} (expected stop or length)")
            # each turn its own prompt object, as its own request would have given
            prompt = EncodedPrompt(
                input_ids=list(prompt_ids), image_ids=list(image_ids), image_spans=list(spans), text=text
            )
            # every marker the budget forced: a completion that opens a new block after one gets the budget again
            starts = (
                forced_markers(prompt_ids, token_ids, logprobs, budget, *self._markers)
                if budget is not None and self._markers is not None
                else []
            )
            written = forced_marker_positions(starts, len(self._markers[1]), len(token_ids)) if self._markers else ()
            completion = Completion(
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason=reason,
                thinking_forced=bool(starts),
                forced=written,
            )
            turns[index] = ChatTurn(prompt, completion, tokenizer.decode(token_ids, skip_special_tokens=True))
        return [turn for turn in turns if turn is not None]

    def _check_video_prompt(
        self,
        conversation: Sequence[Mapping[str, Any]],
        prompt_ids: list[int],
        template_kwargs: Mapping[str, Any] | None,
        where: str,
    ) -> EncodedPrompt:
        """The trainer's own encoding of a conversation with a video, which the server's prompt must be: timestamps
        and the markup around each video's expansion are text a server writes on its own terms."""
        mine = self.prompts.encode(conversation, template_kwargs=template_kwargs, where=where)
        difference = prompt_difference(prompt_ids, mine.input_ids, self.prompts.tokenizer)
        if difference is None:
            return mine
        raise RolloutServerError(
            f"{where}: the server's prompt for this video conversation is not the trainer's processor's: {difference}. "
            "The server expands videos otherwise (a vLLM other than 0.24? the family's vllm_video_wrapper, "
            "docs/serving.md)"
        )

    def _image_spans(self, prompt_ids: list[int], image_ids: list[str], where: str) -> list[tuple[int, int]]:
        """Where each image's expansion (as the trainer's processor gives it) stands in the server's prompt, in
        order."""
        spans, at = [], 0
        for k, image_id in enumerate(image_ids):
            expansion = list(self.prompts.image(image_id).token_ids)
            n = len(expansion)
            start = next((i for i in range(at, len(prompt_ids) - n + 1) if prompt_ids[i : i + n] == expansion), None)
            if start is None:
                raise RolloutServerError(
                    f"{where}: image {k + 1} of {len(image_ids)}: the server's prompt does not hold the {n} tokens the "
                    "trainer's processor gives this image: trainer and server disagree on the processor (image sizes, "
                    "patch or merge settings)"
                )
            spans.append((start, start + n))
            at = start + n
        return spans
