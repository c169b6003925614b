"""How `vlmreg serve` bounds its clients' connections and the threads that handle them (stdlib only).

`Admission` takes each connection the listening socket accepts. At most ``max_connections`` are open at once: past
it, a connection is refused at once. At most ``max_handlers`` of the open ones have a handler thread (reading the
request, waiting for the model, answering); the others wait first come, first served, holding a socket but no
thread, until a handler is free (it takes the oldest) or ``wait_s`` has passed (refused). So however many clients
stall or idle, the server's threads stay bounded. A refusal is a 503 with ``Retry-After: 1`` written at once,
without blocking, by whichever thread refuses; one housekeeping thread then reads and drops what the client still
sends for `REFUSAL_LINGER_S`, so closing the socket does not reset the connection under the answer.

`Watchdog` cuts connections whose request has not arrived by its deadline (the request line and headers together,
or the body), which a per-read socket timeout alone cannot do against a client that drips a byte at a time.
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any

__all__ = ["DRAIN_LIMIT", "REFUSAL_LINGER_S", "Admission", "Watchdog", "overloaded_answer"]

DRAIN_LIMIT = 1 << 20  # a refused request's body is read and dropped up to this size, so the client sees the answer
REFUSAL_LINGER_S = 2.0  # how long a refused connection is drained before it is closed
MAX_LINGERING = 1024  # refused connections drained at once; past it the oldest is closed
TICK_S = 0.05

Handle = Callable[[socket.socket, Any], None]


def overloaded_answer(message: str) -> bytes:
    """A whole HTTP answer: 503, ``Retry-After: 1``, ``Connection: close`` and an OpenAI error ``overloaded``."""
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": "overloaded"}}).encode()
    head = (
        "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


class Admission:
    """Open connections capped at ``max_connections``, handler threads at ``max_handlers``; see the module.

    ``handle(sock, address)`` serves one connection to its end and closes it; it must not raise. ``wait_s()`` is
    how long a connection may wait for a handler, read when it starts waiting.
    """

    def __init__(self, handle: Handle, *, max_connections: int, max_handlers: int, wait_s: Callable[[], float]) -> None:
        self.handle, self.max_connections, self.max_handlers, self.wait_s = handle, max_connections, max_handlers, wait_s
        self.refused = 0  # connections answered 503 by this class, for logs and tests
        self._lock = threading.Lock()
        self._open = 0  # handled or waiting
        self._handlers = 0
        self._waiting: deque[tuple[float, socket.socket, Any]] = deque()
        self._refusals: SimpleQueue[socket.socket] = SimpleQueue()
        self._lingering: dict[socket.socket, tuple[float, int]] = {}  # the housekeeping thread's own
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def handlers(self) -> int:
        """Handler threads running now."""
        return self._handlers

    @property
    def waiting(self) -> int:
        """Connections waiting for a handler now."""
        return len(self._waiting)

    def admit(self, sock: socket.socket, address: Any) -> None:
        """Take one new connection (from the accepting thread); never blocks."""
        with self._lock:
            full = self._open >= self.max_connections
            start = not full and self._handlers < self.max_handlers
            if not full:
                self._open += 1
                if start:
                    self._handlers += 1
                else:
                    self._waiting.append((time.monotonic() + self.wait_s(), sock, address))
        if full:
            self.refuse(sock, f"the server is at capacity: {self.max_connections} connections are open; retry later")
        elif start:
            try:
                threading.Thread(target=self._run, args=(sock, address), name="vlmreg-serve-handler", daemon=True).start()
            except RuntimeError as exc:  # no thread to be had: say so instead of dropping the client
                with self._lock:
                    self._open -= 1
                    self._handlers -= 1
                self.refuse(sock, f"the server is at capacity: cannot start a handler thread ({exc}); retry later")
        else:
            self._start_housekeeping()

    def refuse(self, sock: socket.socket, message: str) -> None:
        """Answer ``sock`` with a 503 now, without blocking, then drain it for a while (housekeeping closes it)."""
        with self._lock:
            self.refused += 1
        answer = overloaded_answer(message)
        try:
            sock.setblocking(False)
            if sock.send(answer) < len(answer):  # a fresh socket's send buffer holds a few hundred bytes
                raise OSError("the answer did not fit the socket's buffer")
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            _close(sock)
            return
        self._refusals.put(sock)
        self._start_housekeeping()

    def close(self) -> None:
        """Stop housekeeping; close the waiting and lingering connections."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for _, sock, _ in waiting:
            _close(sock)
        while True:
            try:
                _close(self._refusals.get_nowait())
            except Empty:
                break

    def _run(self, sock: socket.socket, address: Any) -> None:
        """A handler thread: serve a connection, then the oldest waiting one, until none waits."""
        while True:
            try:
                self.handle(sock, address)
            except BaseException:  # noqa: BLE001 - `handle` must not raise; if it does, the thread still counts right
                pass
            with self._lock:
                self._open -= 1
                if not self._waiting:
                    self._handlers -= 1
                    return
                _, sock, address = self._waiting.popleft()

    def _start_housekeeping(self) -> None:
        with self._lock:
            if self._thread is None and not self._stopped.is_set():
                self._thread = threading.Thread(target=self._housekeep, name="vlmreg-serve-refusals", daemon=True)
                self._thread.start()

    def _housekeep(self) -> None:
        """Drain and close refused connections; refuse those that waited too long for a handler."""
        selector = selectors.DefaultSelector()
        try:
            while not self._stopped.is_set():
                if self._lingering:
                    for key, _ in selector.select(TICK_S):
                        self._drain(selector, key.fileobj)  # type: ignore[arg-type]
                else:
                    self._stopped.wait(TICK_S)
                self._take_refusals(selector)
                now = time.monotonic()
                for sock in [s for s, (due, _) in self._lingering.items() if due <= now]:
                    self._forget(selector, sock)
                with self._lock:
                    expired = [entry for entry in self._waiting if entry[0] <= now]
                    for entry in expired:
                        self._waiting.remove(entry)
                        self._open -= 1
                for _, sock, _ in expired:
                    self.refuse(sock, f"the server is at capacity: every handler was busy for {self.wait_s():g} s; retry later")
        finally:
            for sock in list(self._lingering):
                self._forget(selector, sock)
            selector.close()

    def _take_refusals(self, selector: selectors.BaseSelector) -> None:
        while True:
            try:
                sock = self._refusals.get_nowait()
            except Empty:
                return
            while len(self._lingering) >= MAX_LINGERING:
                self._forget(selector, next(iter(self._lingering)))
            try:
                selector.register(sock, selectors.EVENT_READ)
            except (OSError, ValueError):
                _close(sock)
                continue
            self._lingering[sock] = (time.monotonic() + REFUSAL_LINGER_S, 0)

    def _drain(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        due, drained = self._lingering[sock]
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data or drained + len(data) > DRAIN_LIMIT:
            self._forget(selector, sock)
        else:
            self._lingering[sock] = (due, drained + len(data))

    def _forget(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        self._lingering.pop(sock, None)
        try:
            selector.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
        _close(sock)


class Watchdog:
    """Cuts connections whose request has not arrived by its deadline.

    The socket timeout bounds each read, so a client that drips a byte just inside it would hold its thread for
    ever; this one thread shuts such connections down (their blocked reads return at once, short).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due: dict[int, tuple[float, socket.socket]] = {}
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self, sock: socket.socket, seconds: float) -> None:
        with self._lock:
            self._due[id(sock)] = (time.monotonic() + seconds, sock)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="vlmreg-serve-deadlines", daemon=True)
                self._thread.start()

    def disarm(self, sock: socket.socket) -> None:
        with self._lock:
            self._due.pop(id(sock), None)

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(TICK_S):
            now = time.monotonic()
            with self._lock:
                expired = [key for key, (due, _) in self._due.items() if due <= now]
                cut = [self._due.pop(key)[1] for key in expired]
            for sock in cut:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
