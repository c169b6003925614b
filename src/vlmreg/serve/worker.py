"""The server's one model thread: it takes whatever requests are pending, batches them, and generates.

Every use of the model, the processor and the image store happens on this thread, so none of them needs
to be thread-safe, and `BatchWorker.between_batches` can hand the model to a function (a weight swap) at
a moment when no batch is running: requests that arrive meanwhile wait in the queue, none is dropped.
Requests batch together when their sampling settings are equal (the trainer's always are: temperature,
top-p, max tokens, stop tokens and strings, logit bias, penalties and thinking budget); a request with a ``seed`` runs
alone, under its own random state, so its answer depends on nothing else. At most ``max_queued`` requests wait;
one more is answered 503 at once.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import attrs
import torch

from vlmreg.data.store import ImageStore
from vlmreg.inference.embedded import EmbeddedEngine, LogitControls
from vlmreg.sdk.engine import Completion, EncodedPrompt, PromptRequest, SamplingParams
from vlmreg.serve.protocol import Answer, ChatRequest, Choice, RequestError
from vlmreg.serve.tokens import TokenText, cut_at_stop

__all__ = ["DEFAULT_MAX_QUEUED", "BatchWorker"]

DEFAULT_MAX_QUEUED = 4096  # requests waiting for a batch; one more is a 503


@attrs.define(eq=False)
class _Job:
    request: ChatRequest
    params: SamplingParams
    controls: LogitControls
    future: Future[Answer]

    @property
    def key(self) -> tuple[Any, ...]:
        """What must be equal for two requests to share a batch."""
        return self.params, self.request.seed, self.controls, self.request.stop


class BatchWorker:
    """Serves `ChatRequest`s in batches of up to ``max_batch`` conversations on one thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        processor: Any,
        device: torch.device,
        *,
        max_batch: int,
        suppress_token_ids: Sequence[int] = (),
        descriptor: Any = None,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ):
        self.model, self.processor, self.device = model, processor, device
        self.max_batch, self.max_queued = max_batch, max_queued
        self.suppress_token_ids = tuple(suppress_token_ids)
        self.store = ImageStore()
        self.engine = EmbeddedEngine(model, processor, self.store, device, batch_size=max_batch, descriptor=descriptor)
        self.text = TokenText(self.engine.encoder.tokenizer)
        config = getattr(model.config, "text_config", model.config)
        self.max_model_len: int | None = getattr(config, "max_position_embeddings", None)
        self.generating = False
        self.batches = 0  # batches served
        self.largest_batch = 0  # conversations in the largest batch so far
        self._pending: deque[_Job] = deque()
        self._hooks: list[tuple[Callable[[torch.nn.Module], Any], Future[Any]]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="vlmreg-serve-worker", daemon=True)

    # -- the public side (any thread) -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: ChatRequest) -> Future[Answer]:
        """Queue a request; the future holds its `Answer`, or a `RequestError`."""
        turn_end = self.engine.encoder.stop_ids
        params = SamplingParams(
            temperature=1.0 if request.greedy else request.temperature,
            top_p=1.0 if request.greedy else request.top_p,
            max_tokens=request.max_tokens,
            stop_token_ids=tuple(sorted({*turn_end, *request.stop_token_ids})),
            suppress_token_ids=self.suppress_token_ids,
            greedy=request.greedy,
            thinking_budget=request.thinking_token_budget,
        )
        controls = LogitControls(request.logit_bias, request.frequency_penalty, request.presence_penalty)
        job = _Job(request, params, controls, Future())
        with self._cond:
            if self._stopping:
                raise RequestError(None, "the server is shutting down", status=503, kind="server_error")
            if len(self._pending) >= self.max_queued:
                raise RequestError(
                    None,
                    f"the server is at capacity: {len(self._pending)} requests are waiting; retry later",
                    status=503,
                    kind="server_error",
                    code="overloaded",
                )
            self._pending.append(job)
            self._cond.notify()
        return job.future

    def between_batches(self, fn: Callable[[torch.nn.Module], Any]) -> Future[Any]:
        """Run ``fn(model)`` on the worker thread after the batch now running (if any) and before the next.

        Returns a future of ``fn``'s result (or its exception). Requests arriving meanwhile are queued.
        """
        future: Future[Any] = Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            self._hooks.append((fn, future))
            self._cond.notify()
        return future

    @property
    def pending(self) -> int:
        """Requests waiting for a batch."""
        with self._cond:
            return len(self._pending)

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the batch now running, answer what is still queued with 503, and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the worker thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._hooks or self._pending or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    break
                hooks, self._hooks = self._hooks, []
                batch = [] if hooks else self._take_batch()
            for fn, future in hooks:
                try:
                    future.set_result(fn(self.model))
                except BaseException as exc:  # the caller gets it; the worker goes on serving
                    future.set_exception(exc)
            if batch:
                self._serve(batch)
        with self._cond:
            jobs, self._pending = list(self._pending), deque()
            hooks, self._hooks = self._hooks, []
        for job in jobs:
            job.future.set_exception(RequestError(None, "the server is shutting down", status=503, kind="server_error"))
        for _, future in hooks:
            future.set_exception(RuntimeError("the server shut down before the function ran"))

    def _take_batch(self) -> list[_Job]:
        """The oldest job and every later one that can share its batch (same settings, room left)."""
        first = self._pending.popleft()
        batch, size = [first], first.request.n
        if first.request.seed is not None:
            return batch
        rest: deque[_Job] = deque()
        for job in self._pending:
            if job.key == first.key and size + job.request.n <= self.max_batch:
                batch.append(job)
                size += job.request.n
            else:
                rest.append(job)
        self._pending = rest
        return batch

    def _encode(self, job: _Job) -> EncodedPrompt:
        messages = []
        for message in job.request.messages:
            content = message["content"]
            if not isinstance(content, str):
                content = [
                    {"type": "image", "image": self.store.add(p["image"])}
                    if p["type"] == "image"
                    else {"type": "video", "video": self.store.add_video(p["video"])}
                    if p["type"] == "video"
                    else p
                    for p in content
                ]
            messages.append({"role": message["role"], "content": content})
        try:
            prompt = self.engine.encoder.encode(messages, template_kwargs=job.request.template_kwargs, where="messages")
        except Exception as exc:  # a template that fails on this input, or images its tokens do not match
            raise RequestError(
                "messages", f"cannot render the conversation with the chat template: {type(exc).__name__}: {exc}"
            ) from None
        if self.max_model_len is not None and len(prompt.input_ids) + job.request.max_tokens > self.max_model_len:
            raise RequestError(
                "max_tokens",
                f"the prompt's {len(prompt.input_ids)} tokens plus max_tokens {job.request.max_tokens} exceed the "
                f"model's {self.max_model_len} positions",
            )
        return prompt

    def _serve(self, batch: list[_Job]) -> None:
        self.generating = True
        live: list[tuple[_Job, list[int]]] = []
        requests: list[PromptRequest] = []
        try:
            for job in batch:
                try:
                    prompt = self._encode(job)
                except RequestError as exc:
                    job.future.set_exception(exc)
                    continue
                live.append((job, prompt.input_ids))
                requests.extend(PromptRequest.of(prompt) for _ in range(job.request.n))
            if requests:
                completions = self._generate(requests, [job for job, _ in live])
                self.largest_batch = max(self.largest_batch, len(requests))
                for job, ids in live:
                    taken, completions = completions[: job.request.n], completions[job.request.n :]
                    job.future.set_result(Answer(ids, [self._choice(c, job.request) for c in taken]))
        except Exception as exc:  # a failure in generate: every request of the batch gets a 500, the server goes on
            error = RequestError(
                None, f"generation failed: {type(exc).__name__}: {exc}", status=500, kind="server_error"
            )
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(error)
        finally:
            # keep only this batch's images (and features)
            self.store.retain({i for r in requests for i in r.image_ids})
            self.batches += 1
            self.generating = False

    def _generate(self, requests: list[PromptRequest], batch: list[_Job]) -> list[Completion]:
        first = batch[0]
        kwargs: dict[str, Any] = {
            "controls": first.controls,
            "stop_when": self.text.stop_check(first.request.stop) if first.request.stop else None,
            "top_logprobs": max(job.request.top_logprobs for job in batch),
        }
        seed = first.request.seed
        if seed is None:
            return self.engine.generate(requests, first.params, **kwargs)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return self.engine.generate(requests, first.params, **kwargs)

    def _choice(self, completion: Completion, request: ChatRequest) -> Choice:
        ids = completion.token_ids
        text, stopped = cut_at_stop(self.text.text(ids), request.stop)
        top: list[list[tuple[str, float, bytes]]] = []
        if request.top_logprobs:
            top = [
                [(self.text.token(t), lp, self.text.bytes(t)) for t, lp in alternatives[: request.top_logprobs]]
                for alternatives in getattr(completion, "top_logprobs", [])
            ]
        return Choice(
            token_ids=ids,
            logprobs=completion.logprobs,
            tokens=[self.text.token(t) for t in ids],
            text=text,
            finish_reason="stop" if stopped else completion.finish_reason,
            token_bytes=[self.text.bytes(t) for t in ids] if request.logprobs else [],
            top=top,
            pieces=self.text.pieces(ids, text) if request.stream else [],
        )
