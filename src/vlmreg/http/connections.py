"""How vlmreg's HTTP servers (`vlmreg.http.server`: ``vlmreg serve``, ``vlmreg env serve``) bound their clients'
connections and the threads that handle them (stdlib only).

`Admission` takes each connection the listening socket accepts. At most ``max_connections`` are open at once: past
it, a connection is refused at once. An open connection is first *received* by one housekeeping thread, without
blocking and without a thread of its own: its request line, headers and (up to `PREFETCH_LIMIT`) body are read
into memory as they arrive, under the same bounds a handler keeps (``idle_s`` for the first byte, ``head_s`` for
the request line and headers, ``body_s(length)`` for the body; a client that misses one is closed without an
answer). Only a request that has fully arrived (or whose body is too large, or chunked, to read ahead, or that
would take the bytes held for all arrivals past `PREFETCH_BUDGET`) goes to a handler thread, which parses it, waits for
the model and answers; at most ``max_handlers`` run, and a request past them waits first come, first served, holding no
thread, until one is free or ``head_s`` has passed (refused). So
clients that stall or idle, however many, hold no thread at all, as in vLLM's asynchronous server.

A refusal is a 503 with ``Retry-After: 1`` written at once, without blocking; the housekeeping thread then reads and
drops what the client still sends for `REFUSAL_LINGER_S`, so closing the socket does not reset the connection under
the answer.

`Watchdog` cuts connections whose request has not arrived by its deadline on a handler thread (the request line and
headers together, or a body too large to read ahead), which a per-read socket timeout alone cannot do against a
client that drips a byte at a time.
"""

from __future__ import annotations

import io
import json
import re
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any

__all__ = [
    "DRAIN_LIMIT",
    "PREFETCH_LIMIT",
    "REFUSAL_LINGER_S",
    "Admission",
    "Replay",
    "Watchdog",
    "overloaded_answer",
    "overloaded_body",
]

DRAIN_LIMIT = 1 << 20  # a refused request's body is read and dropped up to this size, so the client sees the answer
PREFETCH_LIMIT = 16 << 20  # bodies up to this size are read before a handler takes the request; larger ones by it
PREFETCH_BUDGET = 256 << 20  # all requests being received hold at most this much; past it one goes to a handler
HEAD_LIMIT = 1 << 20  # a request line and headers still unfinished past this size go to a handler (which answers 431)
REFUSAL_LINGER_S = 2.0  # how long a refused connection is drained before it is closed
MAX_LINGERING = 1024  # refused connections drained at once; past it the oldest is closed
TICK_S = 0.05
_HEAD_END = re.compile(rb"\r?\n\r?\n")

Handle = Callable[[socket.socket, Any, bytes], None]


def overloaded_body(message: str) -> dict[str, Any]:
    """An OpenAI error ``overloaded`` (the refusal body unless the server gives its own)."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": "overloaded"}}


def overloaded_answer(message: str, refusal_body: Callable[[str], dict[str, Any]] = overloaded_body) -> bytes:
    """A whole HTTP answer: 503, ``Retry-After: 1``, ``Connection: close`` and ``refusal_body(message)``."""
    body = json.dumps(refusal_body(message)).encode()
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


def body_length(head: bytes) -> int | None:
    """The body length the headers announce (0: none); ``None`` when a handler must decide (chunked, two or bad
    ``Content-Length`` values), so such a request is not read ahead."""
    lengths, chunked = [], False
    for line in head.split(b"\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            chunked = True
        elif name == b"content-length":
            lengths.append(value.strip())
    if chunked or len(lengths) > 1 or (lengths and not lengths[0].isdigit()):
        return None
    return int(lengths[0]) if lengths else 0


class _Arrival:
    """A connection being received: what it has sent so far and its next deadline."""

    __slots__ = ("address", "connected", "data", "due", "needed", "sock")

    def __init__(self, sock: socket.socket, address: Any, idle_s: float) -> None:
        self.sock, self.address, self.data = sock, address, bytearray()
        self.connected = time.monotonic()
        self.due = self.connected + idle_s  # the first byte's; then the head's, then the body's
        self.needed: int | None = None  # bytes of head and body together, once the head is in


class Admission:
    """Open connections capped at ``max_connections``, handler threads at ``max_handlers``; see the module.

    ``handle(sock, address, received)`` serves one connection to its end, ``received`` being the bytes already
    read from it, and closes it; it must not raise. ``idle_s()``, ``head_s()`` and ``body_s(length)`` are the
    deadlines, read when each starts; ``head_s()`` also bounds a wait for a handler. ``refusal_body(message)`` is the
    JSON body of a 503; ``name`` prefixes the threads' names (``NAME-handler``, ``NAME-connections``).
    """

    def __init__(
        self,
        handle: Handle,
        *,
        max_connections: int,
        max_handlers: int,
        idle_s: Callable[[], float],
        head_s: Callable[[], float],
        body_s: Callable[[int], float],
        refusal_body: Callable[[str], dict[str, Any]] = overloaded_body,
        name: str = "vlmreg-serve",
    ) -> None:
        self.handle, self.max_connections, self.max_handlers = handle, max_connections, max_handlers
        self.refusal_body, self.name = refusal_body, name
        self.idle_s, self.head_s, self.body_s = idle_s, head_s, body_s
        self.refused = 0  # connections answered 503 by this class, for logs and tests
        self._lock = threading.Lock()
        self._open = 0  # being received, handled or waiting for a handler
        self._handlers = 0
        self._waiting: deque[tuple[float, socket.socket, Any, bytes]] = deque()
        self._arrivals_in: SimpleQueue[_Arrival] = SimpleQueue()
        self._refusals: SimpleQueue[socket.socket] = SimpleQueue()
        self._arrivals: dict[socket.socket, _Arrival] = {}  # the housekeeping thread's own, as are the two below
        self._lingering: dict[socket.socket, tuple[float, int]] = {}
        self._buffered = 0  # bytes held by the arrivals
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def handlers(self) -> int:
        """Handler threads running now."""
        return self._handlers

    @property
    def waiting(self) -> int:
        """Requests waiting for a handler now."""
        return len(self._waiting)

    @property
    def receiving(self) -> int:
        """Connections whose request is still arriving (no thread holds them)."""
        return len(self._arrivals)

    def admit(self, sock: socket.socket, address: Any) -> None:
        """Take one new connection (from the accepting thread); never blocks."""
        with self._lock:
            full = self._open >= self.max_connections
            if not full:
                self._open += 1
        if full:
            self.refuse(sock, f"the server is at capacity: {self.max_connections} connections are open; retry later")
            return
        try:
            sock.setblocking(False)
        except OSError:
            self._gone(sock)
            return
        self._arrivals_in.put(_Arrival(sock, address, self.idle_s()))
        self._wake()

    def refuse(self, sock: socket.socket, message: str) -> None:
        """Answer ``sock`` with a 503 now, without blocking, then drain it for a while (housekeeping closes it)."""
        with self._lock:
            self.refused += 1
        answer = overloaded_answer(message, self.refusal_body)
        try:
            sock.setblocking(False)
            if sock.send(answer) < len(answer):  # a fresh socket's send buffer holds a few hundred bytes
                raise OSError("the answer did not fit the socket's buffer")
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            _close(sock)
            return
        self._refusals.put(sock)
        self._wake()

    def close(self) -> None:
        """Stop housekeeping; close every connection not on a handler."""
        self._stopped.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for _, sock, _, _ in waiting:
            _close(sock)
        for pending in (self._arrivals_in, self._refusals):
            while True:
                try:
                    item = pending.get_nowait()
                except Empty:
                    break
                _close(item.sock if isinstance(item, _Arrival) else item)
        _close(self._wake_read)
        _close(self._wake_write)

    # -- handlers ------------------------------------------------------------------------------------------
    def _dispatch(self, sock: socket.socket, address: Any, received: bytes) -> None:
        """A request that has arrived: to a free handler thread, else in line for one."""
        with self._lock:
            start = self._handlers < self.max_handlers
            if start:
                self._handlers += 1
            else:
                self._waiting.append((time.monotonic() + self.head_s(), sock, address, received))
        if not start:
            return
        try:
            threading.Thread(
                target=self._run, args=(sock, address, received), name=f"{self.name}-handler", daemon=True
            ).start()
        except RuntimeError as exc:  # no thread to be had: say so instead of dropping the client
            with self._lock:
                self._handlers -= 1
                self._open -= 1
            self.refuse(sock, f"the server is at capacity: cannot start a handler thread ({exc}); retry later")

    def _run(self, sock: socket.socket, address: Any, received: bytes) -> None:
        """A handler thread: serve a request, then the oldest waiting one, until none waits."""
        while True:
            try:
                self.handle(sock, address, received)
            except BaseException:  # noqa: BLE001 - `handle` must not raise; if it does, the thread still counts right
                pass
            with self._lock:
                self._open -= 1
                if not self._waiting:
                    self._handlers -= 1
                    return
                _, sock, address, received = self._waiting.popleft()

    def _gone(self, sock: socket.socket) -> None:
        """A connection closed before a handler took it."""
        _close(sock)
        with self._lock:
            self._open -= 1

    # -- housekeeping: receiving, refusing, draining --------------------------------------------------------
    def _wake(self) -> None:
        with self._lock:
            if self._thread is None and not self._stopped.is_set():
                self._thread = threading.Thread(target=self._housekeep, name=f"{self.name}-connections", daemon=True)
                self._thread.start()
        try:
            self._wake_write.send(b"x")
        except OSError:  # the pipe is full (the thread wakes anyway) or closed
            pass

    def _housekeep(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._wake_read, selectors.EVENT_READ)
        try:
            while not self._stopped.is_set():
                for key, _ in selector.select(TICK_S):
                    if key.fileobj is self._wake_read:
                        try:
                            while self._wake_read.recv(4096):
                                pass
                        except OSError:
                            pass
                    elif isinstance(key.data, _Arrival):
                        self._receive(selector, key.data)
                    else:
                        self._drain(selector, key.fileobj)  # type: ignore[arg-type]
                self._take_new(selector)
                self._expire(selector, time.monotonic())
        finally:
            for arrival in list(self._arrivals.values()):
                self._drop(selector, arrival)
            for sock in list(self._lingering):
                self._forget(selector, sock)
            selector.close()

    def _take_new(self, selector: selectors.BaseSelector) -> None:
        while True:
            try:
                arrival = self._arrivals_in.get_nowait()
            except Empty:
                break
            try:
                selector.register(arrival.sock, selectors.EVENT_READ, arrival)
            except (OSError, ValueError):
                self._gone(arrival.sock)
                continue
            self._arrivals[arrival.sock] = arrival
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

    def _expire(self, selector: selectors.BaseSelector, now: float) -> None:
        for arrival in [a for a in self._arrivals.values() if a.due <= now]:
            self._drop(selector, arrival)
        for sock in [s for s, (due, _) in self._lingering.items() if due <= now]:
            self._forget(selector, sock)
        with self._lock:
            expired = [entry for entry in self._waiting if entry[0] <= now]
            for entry in expired:
                self._waiting.remove(entry)
                self._open -= 1
        for _, sock, _, _ in expired:
            self.refuse(sock, f"the server is at capacity: every handler was busy for {self.head_s():g} s; retry later")

    def _receive(self, selector: selectors.BaseSelector, arrival: _Arrival) -> None:
        try:
            chunk = arrival.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client went away before its request was in
            self._drop(selector, arrival)
            return
        first = not arrival.data
        arrival.data += chunk
        self._buffered += len(chunk)
        if self._buffered > PREFETCH_BUDGET:  # memory first: this one is read on by a handler, with its deadlines
            self._hand_over(selector, arrival)
            return
        if arrival.needed is None:
            if first:
                arrival.due = arrival.connected + self.head_s()
            end = _HEAD_END.search(arrival.data)
            if end is None:
                if len(arrival.data) > HEAD_LIMIT:
                    self._hand_over(selector, arrival)
                return
            length = body_length(bytes(arrival.data[: end.start()]))
            if length is None or length > PREFETCH_LIMIT:
                self._hand_over(selector, arrival)
                return
            arrival.needed = end.end() + length
            arrival.due = time.monotonic() + self.body_s(length)
        if len(arrival.data) >= arrival.needed:
            self._hand_over(selector, arrival)

    def _hand_over(self, selector: selectors.BaseSelector, arrival: _Arrival) -> None:
        self._arrivals.pop(arrival.sock)
        self._buffered -= len(arrival.data)
        self._unregister(selector, arrival.sock)
        self._dispatch(arrival.sock, arrival.address, bytes(arrival.data))

    def _drop(self, selector: selectors.BaseSelector, arrival: _Arrival) -> None:
        """An arrival that went away or missed its deadline: closed, no answer owed (as a handler's watchdog does)."""
        self._arrivals.pop(arrival.sock)
        self._buffered -= len(arrival.data)
        self._unregister(selector, arrival.sock)
        self._gone(arrival.sock)

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

    @staticmethod
    def _unregister(selector: selectors.BaseSelector, sock: socket.socket) -> None:
        try:
            selector.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass

    def _forget(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        self._lingering.pop(sock, None)
        self._unregister(selector, sock)
        _close(sock)


class Replay(io.RawIOBase):
    """Bytes `Admission` already received, then the rest of the connection (a handler's ``rfile``)."""

    def __init__(self, received: bytes, rest: io.BufferedIOBase) -> None:
        self._received, self._rest = memoryview(received), rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._received:
            n = min(len(buffer), len(self._received))
            buffer[:n] = self._received[:n]
            self._received = self._received[n:]
            return n
        return self._rest.readinto1(buffer)  # one read: readinto would wait to fill the whole buffer

    def close(self) -> None:
        self._rest.close()
        super().close()


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
                self._thread = threading.Thread(target=self._run, name="vlmreg-http-deadlines", daemon=True)
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
