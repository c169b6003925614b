"""Small JSON-over-HTTP calls the trainer makes to a rollout server (health, weight syncs), with clear errors."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vlmreg.broadcast import BroadcastError, LayoutMismatchError, ReceiverGaveUp
from vlmreg.sdk.errors import VlmregError

__all__ = ["HttpStatusError", "alongside", "auth_headers", "free_port", "get_json", "join_while_alive", "on_every_server", "post_json", "wait_healthy"]

#: How often a long wait for a server says that it is still waiting (seconds).
PROGRESS_EVERY_S = 30.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HttpStatusError(VlmregError):
    """The server answered with an error status; ``status`` says which."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _message(raw: bytes, fallback: str) -> str:
    """The error text of an answer body: OpenAI's ``error.message``, FastAPI's ``detail``, vLLM's ``error``, or the text."""
    try:
        body = json.loads(raw)
    except ValueError:
        text = raw.decode("utf-8", "replace").strip()
        return text[:500] or fallback
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("detail", "error", "message"):
            if body.get(key):
                return str(body[key])
    return fallback


def _call(request: urllib.request.Request, timeout: float) -> Any:
    url = request.full_url
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        raise HttpStatusError(f"{url}: {exc.code} {_message(exc.read(), str(exc.reason))}", exc.code) from None
    except (urllib.error.URLError, OSError) as exc:
        raise VlmregError(f"{url}: no answer ({getattr(exc, 'reason', exc)})") from None
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError:
        return {"text": raw.decode("utf-8", "replace")}


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer KEY`` for a server that checks an API key; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def post_json(url: str, body: dict[str, Any] | None, timeout: float, *, api_key: str | None = None,
              headers: dict[str, str] | None = None) -> Any:
    """POST ``body`` as JSON; the decoded answer (``{}`` for an empty one). Errors name the URL and the server's message.

    ``api_key`` is sent as ``Authorization: Bearer KEY``; ``headers`` are added as given."""
    data = json.dumps(body if body is not None else {}).encode()
    sent = {"Content-Type": "application/json", **auth_headers(api_key), **(headers or {})}
    return _call(urllib.request.Request(url, data=data, headers=sent), timeout)


def get_json(url: str, timeout: float, *, api_key: str | None = None, headers: dict[str, str] | None = None) -> Any:
    return _call(urllib.request.Request(url, headers={**auth_headers(api_key), **(headers or {})}), timeout)


def alongside(ask: Callable[[], Any], transfer: Callable[[], Any], *, what: str, url: str, timeout_s: float,
              check_alive: Callable[[], None]) -> Any:
    """Ask the server over HTTP (on a thread) while the collective ``transfer`` runs here; both must succeed.

    Returns the server's answer. A failed transfer or answer is a `VlmregError` saying the server at ``url`` did not
    ``what``; ``check_alive`` runs first, so a dead server is reported as such.
    """
    answer: dict[str, Any] = {}

    def run() -> None:
        try:
            answer["body"] = ask()
        except VlmregError as exc:
            answer["error"] = exc

    thread = threading.Thread(target=run, name="vlmreg-weights-post", daemon=True)
    thread.start()
    try:
        transfer()
    except BroadcastError as exc:
        thread.join(5)  # a server that refused the request (so never took part) says why; that is the error to report
        check_alive()
        if "error" in answer:
            raise answer["error"] from None
        raise VlmregError(f"the rollout server at {url} did not {what}: {exc}") from None
    thread.join(timeout_s + 60)
    if "error" in answer:
        check_alive()
        raise answer["error"]
    if thread.is_alive():
        raise VlmregError(f"the rollout server at {url} did not confirm that it could {what} in time")
    return answer.get("body")


def wait_healthy(url: str, *, timeout_s: float, check_alive: Callable[[], None], interval_s: float, api_key: str | None = None,
                 progress: Callable[[float], None] | None = None) -> float:
    """Poll ``url/health`` until it answers 200 (``check_alive`` first, each time, so a dead server is an error at once);
    the seconds it took, or ``TimeoutError`` past ``timeout_s``. ``progress(seconds)`` is called every
    `PROGRESS_EVERY_S` while it waits, so a long start is never silent."""
    started = time.monotonic()
    said = started
    while True:
        check_alive()
        try:
            get_json(f"{url}/health", timeout=5, api_key=api_key)
            return time.monotonic() - started
        except VlmregError:
            pass
        now = time.monotonic()
        if now - started > timeout_s:
            raise TimeoutError(f"{url}/health did not answer within {timeout_s:g} s")
        if progress is not None and now - said >= PROGRESS_EVERY_S:
            said = now
            progress(now - started)
        time.sleep(interval_s)


def join_while_alive(connect: Callable[[float], None], *, timeout_s: float, check_alive: Callable[[], None],
                     what: str, gave_up: Callable[[], bool] = lambda: False, progress: Callable[[float], None] | None = None) -> None:
    """Wait up to ``timeout_s`` for a server to join a weight group, as ``connect(seconds)`` tries for short spells,
    calling ``check_alive`` between them: a server that exits while the trainer waits is an error at once (its exit code
    and log), not a wait of the whole timeout. ``gave_up()`` true ends the wait quietly (the caller reports why);
    ``progress(seconds)`` is called every `PROGRESS_EVERY_S`. Past the timeout: a `BroadcastError` naming ``what``."""
    started = said = time.monotonic()
    while True:
        check_alive()
        try:
            return connect(0.5)
        except (LayoutMismatchError, ReceiverGaveUp):
            raise
        except BroadcastError as exc:
            if gave_up():
                return
            now = time.monotonic()
            if now - started > timeout_s:
                raise BroadcastError(f"{what} did not join within {timeout_s:g} s ({exc})") from None
            if progress is not None and now - said >= PROGRESS_EVERY_S:
                said = now
                progress(now - started)


def on_every_server(urls: list[str], call: Callable[[int, str], Any]) -> list[Any]:
    """``call(index, url)`` for every server at once (each request names its own URL in an error); the answers in
    server order, or the first server's error."""
    if len(urls) == 1:
        return [call(0, urls[0])]
    with ThreadPoolExecutor(len(urls), thread_name_prefix="vlmreg-servers") as pool:
        futures = [pool.submit(call, index, url) for index, url in enumerate(urls)]
    return [future.result() for future in futures]
