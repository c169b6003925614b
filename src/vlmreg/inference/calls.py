"""The trainer's waits on its rollout servers: health polls, weight-group joins, requests beside a collective, and
one request to every server at once. The requests themselves go through `vlmreg.http.client`."""

from __future__ import annotations

import contextvars
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vlmreg.broadcast import BroadcastError, LayoutMismatchError, ReceiverGaveUp
from vlmreg.http.client import get_json
from vlmreg.sdk.errors import VlmregError

__all__ = [
    "ServerCall",
    "alongside",
    "check_request_in_flight",
    "free_port",
    "join_while_alive",
    "on_every_server",
    "transfer_alongside",
    "wait_healthy",
]

#: How often a long wait for a server says that it is still waiting (seconds).
PROGRESS_EVERY_S = 30.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerCall:
    """A request to the rollout server(s) running on a thread of its own from the moment it is made; its answer (or
    error, a `VlmregError`) is taken later with `result`, so the caller may do other things meanwhile, or stop waiting
    for it once it learnt the same news another way (`transfer_alongside` with ``confirmed``)."""

    def __init__(self, ask: Callable[[], Any], name: str = "vlmreg-weights-post") -> None:
        self._outcome: dict[str, Any] = {}
        self._done = threading.Event()

        def run() -> None:
            try:
                self._outcome["body"] = ask()
            except VlmregError as exc:
                self._outcome["error"] = exc
            except BaseException as exc:  # noqa: BLE001 - handed to whoever takes the result
                self._outcome["error"] = VlmregError(f"the request failed: {type(exc).__name__}: {exc}")
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> VlmregError | None:
        return self._outcome.get("error") if self.done() else None

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    def result(self, timeout_s: float, *, what: str, url: str) -> Any:
        """The answer, waiting up to ``timeout_s``; its error raised; a `VlmregError` naming ``url`` when it is still
        unanswered then."""
        if not self._done.wait(timeout_s):
            raise VlmregError(f"the rollout server at {url} did not confirm that it could {what} in time")
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome.get("body")


#: The request a `transfer_alongside` in this thread waits beside, while its transfer runs.
_IN_FLIGHT: contextvars.ContextVar[ServerCall | None] = contextvars.ContextVar("vlmreg_request_in_flight", default=None)


def check_request_in_flight() -> None:
    """Raise the error of the request that a transfer running in this thread waits beside, if that request failed: a
    server that refused it, or dropped the connection (an attached one, whose process nobody can watch), is named at
    once instead of after the transfer's timeout. A sender calls it through its ``alive`` check while it waits."""
    call = _IN_FLIGHT.get()
    if call is not None and call.error is not None:
        raise call.error


def transfer_alongside(
    call: ServerCall,
    transfer: Callable[[], Any],
    *,
    what: str,
    url: str,
    timeout_s: float,
    check_alive: Callable[[], None],
    confirmed: Callable[[], bool] | None = None,
) -> bool:
    """Run the collective ``transfer`` here while ``call`` (the request that makes the server take part) is under way,
    then wait until the server answered or, with ``confirmed``, until it is true (every worker confirmed through the
    transport itself, which comes before its answer has crossed the engine and HTTP): ``True`` then, the answer still
    to be taken (`ServerCall.result`). A failed transfer or answer is a `VlmregError` saying the server at ``url`` did
    not ``what``; ``check_alive`` runs first, so a dead server is reported as such."""
    token = _IN_FLIGHT.set(call)
    try:
        transfer()
    except BroadcastError as exc:
        call.wait(5)  # a server that refused the request (so never took part) says why; that is the error to report
        check_alive()
        if call.error is not None:
            raise call.error from None
        raise VlmregError(f"the rollout server at {url} did not {what}: {exc}") from None
    finally:
        _IN_FLIGHT.reset(token)
    if confirmed is not None:
        started = time.monotonic()
        deadline = started + timeout_s + 60
        while not call.done():
            if confirmed():
                return True
            now = time.monotonic()
            if now > deadline:
                break
            time.sleep(0.0001 if now - started < 0.05 else 0.002)
    call.wait(timeout_s + 60)
    if call.error is not None:
        check_alive()
    call.result(0, what=what, url=url)
    return False


def alongside(
    ask: Callable[[], Any],
    transfer: Callable[[], Any],
    *,
    what: str,
    url: str,
    timeout_s: float,
    check_alive: Callable[[], None],
) -> Any:
    """Ask the server over HTTP (on a thread) while the collective ``transfer`` runs here; both must succeed.

    Returns the server's answer. A failed transfer or answer is a `VlmregError` saying the server at ``url`` did not
    ``what``; ``check_alive`` runs first, so a dead server is reported as such.
    """
    call = ServerCall(ask)
    transfer_alongside(call, transfer, what=what, url=url, timeout_s=timeout_s, check_alive=check_alive)
    return call.result(0, what=what, url=url)


def wait_healthy(
    url: str,
    *,
    timeout_s: float,
    check_alive: Callable[[], None],
    interval_s: float,
    api_key: str | None = None,
    progress: Callable[[float], None] | None = None,
) -> float:
    """Poll ``url/health`` until it answers 200 (``check_alive`` first, each time, so a dead server is an error at
    once); the seconds it took, or ``TimeoutError`` past ``timeout_s``. ``progress(seconds)`` is called every
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


def join_while_alive(
    connect: Callable[[float], None],
    *,
    timeout_s: float,
    check_alive: Callable[[], None],
    what: str,
    gave_up: Callable[[], bool] = lambda: False,
    progress: Callable[[float], None] | None = None,
) -> None:
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
