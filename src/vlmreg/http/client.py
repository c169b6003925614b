"""One JSON-over-HTTP client for the requests vlmreg makes: the OpenAI engine's, the remote environments' and the
trainer's (health checks, weight syncs). Stdlib only (urllib, so ``http_proxy`` / ``no_proxy`` are honoured).

`JsonClient(url, ...)` sends a JSON body (or none) and decodes a JSON answer:

- auth: ``api_key`` goes on every request as ``Authorization: Bearer KEY``;
- time: ``timeout_s`` bounds each attempt as a whole (connecting, the request, the answer's headers and body: a
  server that drips its answer a byte at a time is cut off at it, not only one that goes silent), and ``deadline_s``,
  when given, bounds the whole call, every attempt and pause included (an attempt gets at most the time left);
- retries: up to ``retries`` more attempts, after ``backoff_s * 2**k`` seconds (at most ``backoff_max_s``), for a
  connection that cannot be made or drops, and for a 5xx answer unless its body says ``"retry": false``; a timeout
  is retried only under a deadline (which bounds what the retries cost); a 4xx answer never;
- errors: `HttpError` (a `VlmregError`) whose message starts with the URL; ``detail`` says what went wrong
  (``HTTP 503: the server's message``, ``cannot connect: ...``, ``no answer within 5 s (SETTING)``, ``gave up after
  4 attempt(s); last: ...``, ``no good answer within 2 s (3 attempt(s); last: ...)``), `HttpStatusError` for an error
  status (``status``, ``server_message``), `AnswerError` for an answer outside its schema, naming the field
  (`field`).

Answers: at most ``max_answer_bytes``; an empty body is ``{}``; a body that is not JSON is an `AnswerError` (or
``{"text": ...}`` with ``plain_text=True``, for servers whose side routes answer plain text).
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from vlmreg.http.connections import Watchdog
from vlmreg.sdk.errors import VlmregError

__all__ = [
    "AnswerError",
    "HttpError",
    "HttpStatusError",
    "JsonClient",
    "auth_headers",
    "field",
    "get_json",
    "post_json",
    "server_message",
]

MAX_ANSWER_BYTES = 256 << 20
_CHUNK = 1 << 16


class HttpError(VlmregError):
    """A request that failed for good: ``url`` (the full URL), ``detail`` (what went wrong), ``attempts`` made."""

    def __init__(self, url: str, detail: str, *, attempts: int = 1) -> None:
        super().__init__(f"{url}: {detail}")
        self.url, self.detail, self.attempts = url, detail, attempts


class HttpStatusError(HttpError):
    """The server answered with an error ``status``; ``server_message`` is its one-line reason."""

    def __init__(
        self, url: str, status: int, server_message: str, *, hint: str = "", attempts: int = 1, detail: str = ""
    ) -> None:
        super().__init__(url, detail or f"HTTP {status}: {server_message}{hint}", attempts=attempts)
        self.status, self.server_message = status, server_message


class AnswerError(HttpError):
    """An answer that is not what the protocol promises: not JSON, too large, or a field missing or of the wrong
    type."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer KEY`` for a server that checks an API key; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def server_message(raw: bytes, fallback: str = "(empty body)") -> tuple[str, bool]:
    """An error body's one-line message and whether it may be retried (``"retry": false`` says not): OpenAI's and
    vlmreg's ``{"error": {"message", "retry"}}``, vLLM's ``{"error": "..."}``, FastAPI's ``detail``, or the text."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return raw[:300].decode("utf-8", "replace").strip() or fallback, True
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"]), error.get("retry", True) is not False
        for key in ("error", "detail", "message"):
            if body.get(key):
                return str(body[key]), True
    return fallback, True


def field(answer: Any, path: str, kind: type | tuple[type, ...], url: str) -> Any:
    """``answer[path]`` (dots separate keys, numbers index lists: ``data.0.id``) when it is a ``kind``; else an
    `AnswerError` naming ``url`` and the field."""
    value, at = answer, []
    for key in path.split("."):
        at.append(key)
        try:
            value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, TypeError, ValueError):
            raise AnswerError(url, f"the answer has no {'.'.join(at)}") from None
    if not isinstance(value, kind) or (
        isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))
    ):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise AnswerError(url, f"the answer's {path} is {type(value).__name__} {value!r:.60}, not {names}")
    return value


class _Retry(Exception):
    """An attempt failed in a way another attempt may not (its text is the error's ``last``)."""

    def __init__(self, detail: str, *, timed_out: bool = False, status: int | None = None, message: str = "") -> None:
        super().__init__(detail)
        self.timed_out, self.status, self.message = timed_out, status, message


_cutter = Watchdog()  # shuts down an attempt's socket when its time is up (a dripping server holds every read)
_attempt = threading.local()  # the running attempt's own end, read when its connection is made


def _tracked(base: type[http.client.HTTPConnection]) -> Any:
    class Tracked(base):  # type: ignore[misc, valid-type]
        def connect(self) -> None:
            super().connect()
            ends = getattr(_attempt, "ends", None)
            if ends is not None:
                _attempt.socks.append(self.sock)
                _cutter.arm(self.sock, max(ends - time.monotonic(), 0.0))

    return Tracked


_HTTPConnection, _HTTPSConnection = _tracked(http.client.HTTPConnection), _tracked(http.client.HTTPSConnection)


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: Any) -> Any:
        return self.do_open(_HTTPConnection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: Any) -> Any:
        return self.do_open(_HTTPSConnection, req, context=self._context)  # type: ignore[attr-defined]


_opener = urllib.request.build_opener(_HTTPHandler, _HTTPSHandler)


class JsonClient:
    """Requests to the server at ``url`` (a base URL; paths are appended); the module says what each option does.

    ``timeout_setting`` names the setting behind ``timeout_s`` in errors (``no answer within 5 s
    (rollout.request_timeout_s)``); ``auth_hint`` is added to a 401's error.
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        deadline_s: float | None = None,
        retries: int = 0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        plain_text: bool = False,
        timeout_setting: str = "",
        auth_hint: str = "",
    ) -> None:
        if not 0 < timeout_s <= math.inf or (deadline_s is not None and not 0 < deadline_s < math.inf):
            raise VlmregError(f"{url}: timeout_s ({timeout_s}) and deadline_s ({deadline_s}) must be positive seconds")
        if retries < 0:
            raise VlmregError(f"{url}: retries ({retries}) must be >= 0")
        self.url, self.api_key, self.timeout_s, self.deadline_s = url.rstrip("/"), api_key, timeout_s, deadline_s
        self.retries, self.backoff_s, self.backoff_max_s = retries, backoff_s, backoff_max_s
        self.max_answer_bytes, self.plain_text, self.auth_hint = max_answer_bytes, plain_text, auth_hint
        self.timeout_setting = timeout_setting

    def get(self, path: str = "", **options: Any) -> Any:
        return self.request("GET", path, None, **options)

    def post(self, path: str = "", body: Any = None, **options: Any) -> Any:
        return self.request("POST", path, {} if body is None else body, **options)

    def request(
        self,
        method: str,
        path: str = "",
        body: Any = None,
        *,
        timeout_s: float | None = None,
        deadline_s: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """``method`` ``path`` with ``body`` as JSON (none when ``None``), retried as the module says; the decoded
        answer. ``timeout_s``, ``deadline_s`` and ``retries`` replace the client's for this call."""
        url = self.url + path
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        retries = self.retries if retries is None else retries
        started = time.monotonic()
        ends = math.inf if deadline_s is None else started + deadline_s
        data = None if body is None else json.dumps(body).encode()
        last, attempt = "no attempt", 0
        while True:
            left = ends - time.monotonic()
            if left <= 0:
                break
            attempt += 1
            try:
                return self._once(method, url, data, min(timeout_s, left), attempt)
            except _Retry as exc:
                last = str(exc)
                # no deadline bounds a retry of a timeout
                if deadline_s is None and (exc.timed_out or attempt > retries):
                    detail = f"gave up after {attempt} attempt(s); last: {last}" if attempt > 1 else last
                    if exc.status is not None:
                        raise HttpStatusError(url, exc.status, exc.message, attempts=attempt, detail=detail) from None
                    raise HttpError(url, detail, attempts=attempt) from None
            pause = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
            if attempt > retries:
                break
            if time.monotonic() + pause >= ends:
                break
            time.sleep(pause)
        assert deadline_s is not None  # without a deadline, the loop above returns or raises
        raise HttpError(
            url, f"no good answer within {deadline_s:g} s ({attempt} attempt(s); last: {last})", attempts=attempt
        )

    def _once(self, method: str, url: str, data: bytes | None, seconds: float, attempt: int) -> Any:
        headers = {"Accept": "application/json", **auth_headers(self.api_key)}
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        ends = time.monotonic() + seconds
        setting = f" ({self.timeout_setting})" if self.timeout_setting and seconds == self.timeout_s else ""
        late = f"no answer within {seconds:g} s{setting}"
        _attempt.ends, _attempt.socks = ends, []
        try:
            with _opener.open(request, timeout=None if math.isinf(seconds) else seconds) as response:
                raw = self._read(response, url, ends)
        except urllib.error.HTTPError as exc:
            message, may_retry = server_message(_read_error(exc))
            if exc.code >= 500 and may_retry:
                raise _Retry(f"HTTP {exc.code}: {message}", status=exc.code, message=message) from None
            raise HttpStatusError(
                url, exc.code, message, hint=self.auth_hint if exc.code == 401 else "", attempts=attempt
            ) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if isinstance(reason, TimeoutError) or time.monotonic() >= ends:
                raise _Retry(late, timed_out=True) from None
            if isinstance(exc, urllib.error.URLError) or isinstance(reason, ConnectionRefusedError):
                raise _Retry(f"cannot connect: {reason}") from None
            raise _Retry(f"connection dropped: {type(reason).__name__}: {reason}") from None
        finally:
            for sock in _attempt.socks:
                _cutter.disarm(sock)
            _attempt.ends = None
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            if self.plain_text:
                return {"text": raw.decode("utf-8", "replace")}
            raise AnswerError(url, f"the answer is not JSON: {raw[:120]!r}", attempts=attempt) from None

    def _read(self, response: Any, url: str, ends: float) -> bytes:
        """The answer's body, at most ``max_answer_bytes`` (the cutter ends a read past ``ends``)."""
        chunks, size = [], 0
        while chunk := response.read1(_CHUNK):
            size += len(chunk)
            if size > self.max_answer_bytes:
                raise AnswerError(url, f"the answer is larger than {self.max_answer_bytes} bytes")
            chunks.append(chunk)
        if time.monotonic() >= ends:  # cut short by the cutter: the body may be incomplete
            raise TimeoutError
        return b"".join(chunks)


def _read_error(exc: urllib.error.HTTPError) -> bytes:
    try:
        return exc.read(1 << 16)
    except (OSError, http.client.HTTPException):
        return b""


def post_json(url: str, body: Any, timeout: float, *, api_key: str | None = None) -> Any:
    """One POST of ``body`` (``None``: ``{}``) to ``url``, no retry (a weight sync is not repeated blindly); the
    decoded answer, ``{}`` for an empty one, ``{"text": ...}`` for plain text. Errors name the URL."""
    return JsonClient(url, api_key=api_key, timeout_s=timeout, plain_text=True).post("", body)


def get_json(url: str, timeout: float, *, api_key: str | None = None) -> Any:
    """One GET of ``url``, no retry; as `post_json`."""
    return JsonClient(url, api_key=api_key, timeout_s=timeout, plain_text=True).get("")
