"""The trainer's side of the remote-environment protocol: episodes played by an environment server over HTTP.

`RemoteEnvironments` is one server: ``verify`` checks it before a run trains (``/health``, ``/info``: protocol,
version and environment name, then a dry ``/reset`` and ``/close``), ``make(example)`` gives one episode's
`RemoteEnvironment`, whose ``reset`` / ``step`` / ``close`` are requests, sent by `vlmreg.http.client.JsonClient`.
Every request is bounded: at most ``concurrency`` in flight to the server, each call within its deadline
(``timeout_s``, retries included), retried with exponential backoff (0.2 s, at most 2 s) on a connection error, a
timeout, or a 5xx the server does not mark ``"retry": false``. Every answer is checked against the schema
(`vlmreg.envs.wire`). Errors name the server: ``environment server URL: POST /step: ...``.
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
import uuid
from typing import Any

from vlmreg.envs.wire import (
    PROTOCOL,
    PROTOCOL_VERSION,
    ProtocolError,
    decode_images,
    example_to_json,
    messages_from_json,
    step_from_json,
)
from vlmreg.http.client import AnswerError, HttpError, HttpStatusError, JsonClient
from vlmreg.sdk.errors import VlmregError

__all__ = ["RemoteEnvironment", "RemoteEnvironmentError", "RemoteEnvironments"]


class RemoteEnvironmentError(VlmregError):
    """An environment server failed, timed out, or answered outside the protocol; the message names it."""


class RemoteEnvironments:
    """One environment server at ``url``; ``name`` (when given) must be the environment it serves."""

    def __init__(
        self,
        url: str,
        store: Any,
        *,
        api_key: str | None = None,
        name: str | None = None,
        timeout_s: float = 60.0,
        concurrency: int = 32,
        retries: int = 3,
    ) -> None:
        self.url, self.store, self.api_key, self.expected = url.rstrip("/"), store, api_key, name
        self.timeout_s, self.retries = timeout_s, retries
        self.client = JsonClient(
            self.url,
            api_key=api_key,
            timeout_s=timeout_s,
            deadline_s=timeout_s,
            retries=retries,
            backoff_s=0.2,
            backoff_max_s=2.0,
            auth_hint=" (check rollout.env_api_key_env)",
        )
        self.gate = threading.BoundedSemaphore(max(1, concurrency))
        self.served: str | None = None
        self._serial = itertools.count()

    @property
    def where(self) -> str:
        return f"environment server {self.url}"

    # -- requests --------------------------------------------------------------------------
    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """One call, with retries, within ``timeout_s`` (default: the client's) in all, a wait for a free connection
        included; the decoded JSON object."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        what = f"{self.where}: {method} {path}"
        left = timeout_s
        if not self.gate.acquire(blocking=False):
            started = time.monotonic()
            if not self.gate.acquire(timeout=timeout_s):
                raise RemoteEnvironmentError(
                    f"{what}: waited {timeout_s:g} s for a free connection (rollout.env_concurrency)"
                )
            left = max(timeout_s - (time.monotonic() - started), 0.001)
        try:
            answer = self.client.request(method, path, body, timeout_s=left, deadline_s=left)
        except HttpError as exc:
            unwell = "" if isinstance(exc, (HttpStatusError, AnswerError)) else "; is the server up and well?"
            raise RemoteEnvironmentError(f"{what}: {exc.detail}{unwell}") from None
        finally:
            self.gate.release()
        if not isinstance(answer, dict):
            raise RemoteEnvironmentError(f"{what}: the answer is not a JSON object")
        return answer

    # -- checks ------------------------------------------------------------------------------
    def verify(self, example: Any) -> dict[str, Any]:
        """Health, info and a dry episode (reset, then close) before a run; `RemoteEnvironmentError` with the reason."""
        try:
            health = self.request("GET", "/health")
            if health.get("status") != "ok":
                raise RemoteEnvironmentError(f"{self.where}: GET /health answered {health!r}, not status 'ok'")
            info = self.request("GET", "/info")
            if info.get("protocol") != PROTOCOL or info.get("version") != PROTOCOL_VERSION:
                raise RemoteEnvironmentError(
                    f"{self.where}: speaks protocol {info.get('protocol')!r} version {info.get('version')!r}; this "
                    f"trainer speaks {PROTOCOL!r} version {PROTOCOL_VERSION}"
                )
            served = info.get("name")
            if not isinstance(served, str):
                raise RemoteEnvironmentError(f"{self.where}: GET /info has no environment 'name'")
            if self.expected is not None and served != self.expected:
                raise RemoteEnvironmentError(
                    f"{self.where}: serves environment {served!r}, but the run asks for {self.expected!r}"
                )
            self.served = served
            dry = self.make(example, dry=True)
            dry.reset(example)
            dry.close()
        except VlmregError as exc:
            raise RemoteEnvironmentError(f"the remote environment failed its check before training: {exc}") from None
        return info

    def make(self, example: Any, *, dry: bool = False) -> RemoteEnvironment:
        episode = f"{'dry-' if dry else ''}{uuid.uuid4().hex[:16]}-{next(self._serial)}"
        return RemoteEnvironment(self, episode)


class RemoteEnvironment:
    """One episode on an environment server: ``reset`` / ``step`` / ``close`` are requests."""

    def __init__(self, server: RemoteEnvironments, episode: str) -> None:
        self.server, self.episode, self.turn, self.finished, self.opened = server, episode, 0, False, False
        self.name = f"remote environment {server.served or server.expected or '?'} at {server.url}"

    def reset(self, example: Any) -> list[dict[str, Any]]:
        body, images = example_to_json(example, self.server.store)
        try:
            json.dumps(body)
        except (TypeError, ValueError):
            raise RemoteEnvironmentError(
                f"{example.id}: the example cannot be sent as JSON (its answer or metadata)"
            ) from None
        self.opened = True
        answer = self.server.request("POST", "/reset", {"episode": self.episode, "example": body, "images": images})
        where = f"{self.server.where}: POST /reset"
        decode_images(answer.get("images") or {}, self.server.store, where)
        messages = messages_from_json(answer.get("messages"), self.server.store, where)
        if not messages:
            raise ProtocolError(f"{where}: 'messages' is empty; the first turn needs a prompt")
        return messages

    def step(self, completion: str) -> Any:
        self.turn += 1
        answer = self.server.request(
            "POST", "/step", {"episode": self.episode, "turn": self.turn, "completion": completion}
        )
        step = step_from_json(answer, self.server.store, f"{self.server.where}: POST /step")
        self.finished = step.done
        return step

    def close(self) -> None:
        if self.finished or not self.opened:  # the server released the episode when it answered done
            return
        self.finished = True
        try:
            self.server.request("POST", "/close", {"episode": self.episode}, timeout_s=min(self.server.timeout_s, 5.0))
        except VlmregError:
            pass

    def __del__(self) -> None:
        """An episode dropped without ``close`` (a caller that only wanted the first prompt, such as the format warm-up)
        is closed in the background, so the server does not keep it until its idle timeout."""
        if self.opened and not self.finished and not sys.is_finalizing():
            try:
                # deferred: optional, its absence is handled here
                from vlmreg.envs.calls import _runtime  # noqa: PLC0415

                _runtime()[1].submit(self.close)
            except RuntimeError:  # the pool is shut down: the server's idle timeout will do
                pass
