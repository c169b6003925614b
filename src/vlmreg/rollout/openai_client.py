"""`OpenAIEngine`: a rollout engine that samples from an OpenAI-compatible server (vlmreg serve, vLLM).

Each conversation is one request (``n = 1``), its images sent as PNG data URIs (lossless, so the server
sees the very pixels of the trainer's `ImageStore`), with ``logprobs`` and ``return_token_ids`` on: the
trainer builds samples from the server's exact prompt and completion token ids, never from re-tokenized
text. The server's prompt is checked against the trainer's processor: its image tokens must number what
the local processor gives the same images, or the two disagree and training would misalign features.

A thinking budget (``SamplingParams.thinking_budget``) travels as ``thinking_token_budget``, the field vLLM and
``vlmreg serve`` both take; a completion whose thinking it ended is found in the returned ids by
`vlmreg.rollout.thinking.budget_ended` (``Completion.thinking_forced``).

Requests run on a bounded thread pool; connection failures and 5xx answers are retried with exponential
backoff, a 4xx or a timeout is not; the final error names the URL and the conversation.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from vlmreg.data.prompts import PromptEncoder, template_messages
from vlmreg.data.store import ImageStore
from vlmreg.rollout.thinking import budget_ended, thinking_markers, vllm_reasoning_config
from vlmreg.sdk.engine import ChatTurn, Completion, EncodedPrompt, SamplingParams
from vlmreg.sdk.errors import VlmregError

if TYPE_CHECKING:
    from vlmreg.config.schema import RolloutSection

__all__ = ["OpenAIEngine", "RolloutServerError"]


class RolloutServerError(VlmregError):
    """The inference server failed a request for good, or answered something the trainer cannot use."""


class _Retryable(Exception):
    """A failure worth another attempt: no connection, a dropped connection, or a 5xx answer."""


def base_url(url: str) -> str:
    """A server's base URL: ``http://host:8000/v1/`` and ``http://host:8000`` both give ``http://host:8000``,
    so the OpenAI routes (``/v1/...``) and a server's own (``/collective_rpc``, ``/health``) are found from either."""
    return url.rstrip("/").removesuffix("/v1")


def png_data_uri(image: Any) -> str:
    """A PIL image as a lossless ``data:image/png;base64,...`` URI."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _server_message(raw: bytes) -> str:
    """The message of an OpenAI-style error body, else the start of the body."""
    try:
        error = json.loads(raw)["error"]
        return str(error["message"] if isinstance(error, Mapping) else error)
    except (ValueError, KeyError, TypeError):
        return raw[:300].decode("utf-8", "replace").strip() or "(empty body)"


class OpenAIEngine:
    """Samples each conversation from an OpenAI-compatible server that returns token ids and logprobs.

    ``url`` is the server's base URL (``http://host:8000``; a trailing ``/v1`` is accepted). ``model``
    defaults to the first one ``GET /v1/models`` lists. ``processor`` and ``store`` are the trainer's. ``api_key``,
    when given, is sent on every request as ``Authorization: Bearer KEY``.
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
    ) -> None:
        self.url = base_url(url)
        # vLLM under the trainer: every request scoped to the weights it holds (`vlmreg.rollout.cache_scope`)
        self.cache_scope = cache_scope
        if cache_scope is not None:
            cache_scope.applied = True
        self.api_key = api_key
        self.processor, self.store, self.model, self.descriptor = processor, store, model, descriptor
        self._prompts: PromptEncoder | None = None
        self._markers: tuple[list[int], list[int]] | None = None  # the family's thinking markers' ids, once a budget asks
        self.max_concurrent, self.timeout_s = max_concurrent, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s

    @classmethod
    def from_config(
        cls, rollout: RolloutSection, processor: Any, store: ImageStore, descriptor: Any = None, *,
        url: str | None = None, api_key: str | None = None, cache_scope: Any = None,
    ) -> OpenAIEngine:
        """The engine a ``[rollout]`` section with ``engine = "openai"`` describes; ``url`` and ``api_key`` (a launched
        server's) replace ``rollout.url`` and the ``VLMREG_API_KEY`` environment variable; ``cache_scope``: a vLLM
        server's (`vlmreg.rollout.cache_scope.CacheScope`), put on every request."""
        url = url or (rollout.urls[0] if rollout.urls else None)
        if url is None:
            raise VlmregError('rollout.url is not set: the OpenAI engine needs the server\'s base URL')
        return cls(
            url, processor, store, max_concurrent=rollout.max_concurrent_rollouts,
            timeout_s=rollout.request_timeout_s, max_retries=rollout.max_retries, descriptor=descriptor,
            api_key=api_key or os.environ.get("VLMREG_API_KEY") or None,  # the key of a server that checks one
            cache_scope=cache_scope,
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
        """One completion per conversation, in order, from requests sent ``max_concurrent`` at a time."""
        if not conversations:
            return []
        names = list(names or [f"conversation {i}" for i in range(len(conversations))])
        if params.thinking_budget is not None and self._markers is None:
            self._markers = thinking_markers(self.prompts.tokenizer, self.descriptor)
            if self._markers is None:
                raise VlmregError("rollout.thinking_budget: the family declares no thinking markers (thinking_start, thinking_end)")
        model = self.model or self._first_model()
        uris: dict[str, str] = {}  # the same image in many conversations (a GRPO group) is encoded once
        payloads = [self._payload(c, params, template_kwargs, model, uris) for c in conversations]
        pool = ThreadPoolExecutor(min(self.max_concurrent, len(payloads)), thread_name_prefix="vlmreg-openai")
        futures = [pool.submit(self._post_with_retries, "/v1/chat/completions", p, n) for p, n in zip(payloads, names, strict=True)]
        try:
            bodies = [f.result() for f in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return [self._turn(c, b, n, params.thinking_budget) for c, b, n in zip(conversations, bodies, names, strict=True)]

    def answer(self, conversation: Sequence[Mapping[str, Any]], params: SamplingParams, *, name: str = "conversation") -> Any:
        """The server's JSON answer to one conversation, unparsed, for the request `chat` sends (for checks that
        compare the server's prompt ids with references themselves, `vlmreg.testing.engine_parity`)."""
        model = self.model or self._first_model()
        return self._post_with_retries("/v1/chat/completions", self._payload(conversation, params, None, model, {}), name)

    # -- requests ------------------------------------------------------------------------------
    def _payload(
        self, conversation: Sequence[Mapping[str, Any]], params: SamplingParams, template_kwargs: Mapping[str, Any] | None, model: str, uris: dict[str, str]
    ) -> dict[str, Any]:
        messages = []
        scope = self.cache_scope
        for message in conversation:
            content = message["content"]
            if not isinstance(content, str):
                parts = []
                for part in content:
                    if part.get("type") == "image":
                        image_id = part["image"]
                        if image_id not in uris:
                            uris[image_id] = png_data_uri(self.store.get(image_id))
                        part = {"type": "image_url", "image_url": {"url": uris[image_id]}}
                        if scope is not None:
                            part["uuid"] = scope.image_uuid(image_id)
                        parts.append(part)
                    else:
                        parts.append(dict(part))
                content = parts
            messages.append({"role": message["role"], "content": content})
        payload: dict[str, Any] = {
            "model": model,
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
        if params.suppress_token_ids:  # the family's vision tokens: no probability on the server either, as in the trainer
            payload["logit_bias"] = {str(i): -100 for i in params.suppress_token_ids}
        if template_kwargs:
            payload["chat_template_kwargs"] = dict(template_kwargs)
        if params.thinking_budget is not None:  # vLLM's name (a SamplingParams field); vlmreg serve takes it too
            payload["thinking_token_budget"] = params.thinking_budget
        if scope is not None:
            payload["cache_salt"] = scope.salt
        return payload

    def _first_model(self) -> str:
        body = self._post_with_retries("/v1/models", None, "GET /v1/models")
        try:
            self.model = str(body["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise RolloutServerError(f"{self.url}/v1/models lists no model; set the model name explicitly") from None
        return self.model

    def _post_with_retries(self, path: str, payload: dict[str, Any] | None, name: str) -> Any:
        """POST ``payload`` (GET when ``None``) and decode the JSON answer, retrying what may pass."""
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            try:
                return self._request(path, payload)
            except _Retryable as exc:
                if attempt + 1 == attempts:
                    raise RolloutServerError(f"{self.url}{path} failed for {name} after {attempts} attempt(s): {exc}") from None
                time.sleep(self.backoff_s * 2**attempt)
            except RolloutServerError as exc:
                raise RolloutServerError(f"{self.url}{path} failed for {name}: {exc}") from None
        raise AssertionError("unreachable")

    def _request(self, path: str, payload: dict[str, Any] | None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            message = f"HTTP {exc.code}: {_server_message(exc.read())}"
            if exc.code >= 500:
                raise _Retryable(message) from None
            flag = vllm_reasoning_config(self.descriptor)
            if "reasoning_config" in message and flag is not None:  # a vLLM started without the markers
                message += f" (start that vLLM with --reasoning-config '{flag}' for rollout.thinking_budget)"
            raise RolloutServerError(message) from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise RolloutServerError(f"no answer within request_timeout_s ({self.timeout_s:g} s)") from None
            raise _Retryable(f"cannot connect: {exc.reason}") from None
        except TimeoutError:
            raise RolloutServerError(f"no answer within request_timeout_s ({self.timeout_s:g} s)") from None
        except (ConnectionError, http.client.HTTPException) as exc:
            raise _Retryable(f"connection dropped: {type(exc).__name__}: {exc}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise RolloutServerError(f"the answer is not JSON: {raw[:200]!r}") from None

    # -- answers -------------------------------------------------------------------------------
    def _turn(self, conversation: Sequence[Mapping[str, Any]], body: Any, name: str, budget: int | None = None) -> ChatTurn:
        where = f"{self.url}: {name}"
        try:
            prompt_ids = [int(t) for t in body["prompt_token_ids"]]
            choice = body["choices"][0]
            token_ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(entry["logprob"]) for entry in choice["logprobs"]["content"]]
            reason = choice["finish_reason"]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise RolloutServerError(
                f"{where}: the answer lacks {exc}: the server must support return_token_ids and logprobs (vlmreg serve; a vLLM with return_token_ids)"
            ) from None
        if len(logprobs) != len(token_ids):
            raise RolloutServerError(f"{where}: {len(token_ids)} completion token ids but {len(logprobs)} logprobs")
        if reason not in ("stop", "length"):
            raise RolloutServerError(f"{where}: finish_reason {reason!r} (expected stop or length)")
        _, image_ids = template_messages(conversation)
        spans = self._image_spans(prompt_ids, image_ids, where)
        tokenizer = self.prompts.tokenizer
        pieces, at = [], 0
        for start, end in spans:  # each image's expansion shown as the placeholder, as the template renders it
            pieces += [tokenizer.decode(prompt_ids[at:start]), self.prompts.placeholder]
            at = end
        text = "".join([*pieces, tokenizer.decode(prompt_ids[at:])])
        prompt = EncodedPrompt(input_ids=prompt_ids, image_ids=image_ids, image_spans=spans, text=text)
        forced = budget is not None and self._markers is not None and budget_ended(prompt_ids, token_ids, logprobs, budget, *self._markers)
        completion = Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=reason, thinking_forced=forced)
        return ChatTurn(prompt, completion, tokenizer.decode(token_ids, skip_special_tokens=True))

    def _image_spans(self, prompt_ids: list[int], image_ids: list[str], where: str) -> list[tuple[int, int]]:
        """Where each image's expansion (as the trainer's processor gives it) stands in the server's prompt, in order."""
        spans, at = [], 0
        for k, image_id in enumerate(image_ids):
            expansion = list(self.prompts.image(image_id).token_ids)
            n = len(expansion)
            start = next((i for i in range(at, len(prompt_ids) - n + 1) if prompt_ids[i : i + n] == expansion), None)
            if start is None:
                raise RolloutServerError(
                    f"{where}: image {k + 1} of {len(image_ids)}: the server's prompt does not hold the {n} tokens the trainer's "
                    "processor gives this image: trainer and server disagree on the processor (image sizes, patch or merge settings)"
                )
            spans.append((start, start + n))
            at = start + n
        return spans
