"""The hardened HTTP server base under ``vlmreg serve`` and ``vlmreg env serve`` (stdlib only).

`HardenedServer` binds ``host:port`` and answers each request with its `route`; what it guarantees, for every
subclass alike:

- connections: accepted by a `ThreadingHTTPServer` (a listen backlog of `LISTEN_BACKLOG`, so a burst of clients
  waits rather than being reset) and handed to `Admission` (`vlmreg.http.connections`), which receives each request
  on one housekeeping thread without blocking, so a client that stalls or idles holds no thread; at most
  ``max_connections`` are open and ``max_handlers`` requests on a handler thread (the others wait in line, holding no
  thread, up to ``read_timeout_s``); past either a 503 with ``Retry-After: 1``;
- time: a request must start within ``idle_timeout_s`` (on a new or a kept-alive connection); every read and write
  on its socket within ``read_timeout_s``; and, as deadlines, its request line and headers together within
  ``read_timeout_s`` and its body within ``read_timeout_s`` plus its length at `MIN_BODY_RATE` (`request_deadline_s`),
  so a client that drips bytes inside the read timeout is cut off too, with no answer;
- size: a body of at most ``max_body_bytes``, refused (413) from its ``Content-Length`` before any of it is read; a
  missing or non-numeric length, or a chunked body, a 411; the stdlib's header limits (431, 414);
- auth: with ``api_key``, every path but ``open_paths`` must carry ``Authorization: Bearer KEY`` (constant-time
  compare), checked before the route runs or any body is read, so a request without the key changes nothing (401
  with ``WWW-Authenticate: Bearer``); without a key only a loopback host may be bound (unless ``insecure_no_api_key``);
- errors: a route raises `RequestError` (status, message; ``headers`` when it has them), answered as the server's
  `error_body` renders it; any other exception is a 500 with one line, its traceback to the log only. A request
  whose body was not read closes its connection.
"""

from __future__ import annotations

import io
import json
import math
import socket
import threading
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vlmreg.http.auth import bearer_matches, check_key, is_loopback
from vlmreg.http.connections import DRAIN_LIMIT, Admission, Replay, Watchdog
from vlmreg.sdk.errors import RequestError, VlmregError

__all__ = ["LISTEN_BACKLOG", "MIN_BODY_RATE", "HardenedHandler", "HardenedServer"]

LISTEN_BACKLOG = 1024  # connections the kernel holds until accepted (the stdlib's 5 resets bursts of clients)
MIN_BODY_RATE = 256 << 10  # bytes/s: a body must arrive within read_timeout_s + its length at this rate
Log = Callable[[str], None]


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    app: HardenedServer

    def process_request(self, request: Any, client_address: Any) -> None:
        """Hand the accepted connection to `Admission`: a handler thread, a place in line, or a 503; never a thread
        each."""
        self.app.admission.admit(request, client_address)

    def handle_connection(self, request: Any, client_address: Any, received: bytes) -> None:
        """Serve one connection (``received``: what `Admission` already read of it) to its end on the calling
        (handler) thread, then close it; never raises."""
        try:
            handler: Any = self.RequestHandlerClass  # a `HardenedHandler`, which takes what `Admission` read as well
            handler(request, client_address, self, received)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class HardenedHandler(BaseHTTPRequestHandler):
    """One connection's requests: the bounds of the module, then `HardenedServer.route`. Subclasses set
    ``server_version`` and ``protocol_version``, and may override `respond` (how a route's answer is written)."""

    server: _HTTPServer

    def __init__(self, request: Any, client_address: Any, server: _HTTPServer, received: bytes = b"") -> None:
        self.received = received  # read by `Admission` before this handler took the connection
        self.body_read = True  # False while an announced body has not been read
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        # every read and write on this connection (socketserver declares ``timeout`` a class setting; here it is the
        # server's)
        self.timeout = self.server.app.read_timeout_s  # type: ignore[misc]
        super().setup()
        if self.received:
            self.rfile = io.BufferedReader(Replay(self.received, self.rfile))

    def handle_one_request(self) -> None:
        """A request must start within ``idle_timeout_s``; its line and headers must all arrive within
        ``read_timeout_s``."""
        app = self.server.app
        if not self._request_starts(app.idle_timeout_s):
            self.close_connection = True
            return
        app.watchdog.arm(self.connection, app.read_timeout_s)
        try:
            super().handle_one_request()
        finally:
            app.watchdog.disarm(self.connection)

    def _request_starts(self, idle_timeout_s: float) -> bool:
        """Whether a request's first byte arrives (or was already read) within ``idle_timeout_s``."""
        self.connection.settimeout(min(idle_timeout_s, self.timeout) if self.timeout is not None else idle_timeout_s)
        try:
            return bool(self.rfile.peek(1))  # type: ignore[attr-defined]
        except OSError:  # TimeoutError included: an idle connection is closed
            return False
        finally:
            self.connection.settimeout(self.timeout)

    def log_message(self, format: str, *args: Any) -> None:
        log = self.server.app.log
        if log is not None:
            log(f"{self.address_string()} {format % args}")

    def do_GET(self) -> None:
        self.answer("GET")

    def do_POST(self) -> None:
        self.answer("POST")

    # -- one request -------------------------------------------------------------------------------------------------
    def answer(self, method: str) -> None:
        app = self.server.app
        app.watchdog.disarm(self.connection)  # the headers are in; the body has its own deadline, the route none
        length = self.headers.get("Content-Length", "")
        self.body_read = not (self.headers.get("Transfer-Encoding") or (length.isdigit() and int(length) > 0))
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        headers: dict[str, str] = {}
        try:
            self.check_key(path)
            status, body = app.route(self, method, path)
        except RequestError as exc:
            status, body, headers = exc.status, app.error_body(exc), dict(getattr(exc, "headers", None) or {})
        except TimeoutError:  # the client stopped sending: drop the connection
            self.close_connection = True
            return
        except Exception as exc:  # a bug: one line to the client, the traceback to the server's log only
            if app.log is not None:
                app.log(traceback.format_exc())
            error = RequestError(None, f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error")
            status, body = 500, app.error_body(error)
        if not self.body_read:  # its unread body would be taken for the next request: this connection ends here
            self.close_connection = True
        self.respond(status, body, headers)

    def check_key(self, path: str) -> None:
        """A 401 unless the server has no key, ``path`` is open, or the request carries the key."""
        app = self.server.app
        if (
            app.api_key is None
            or path in app.open_paths
            or bearer_matches(self.headers.get("Authorization"), app.api_key)
        ):
            return
        self.drain()
        missing = not self.headers.get("Authorization")
        message = (
            "no API key: send the server's key as 'Authorization: Bearer KEY'"
            if missing
            else "the API key is not this server's (send 'Authorization: Bearer KEY')"
        )
        raise RequestError(None, message, status=401, code="invalid_api_key")

    def drain(self) -> None:
        """Read and drop a small body, so closing the connection does not reset it under the answer."""
        length = self.headers.get("Content-Length", "")
        self.close_connection = True
        if length.isdigit() and int(length) <= DRAIN_LIMIT:
            try:
                self._read_within_deadline(int(length))
            except OSError:  # TimeoutError included: nothing more to read
                pass

    def body(self) -> bytes:
        """The request's body: its ``Content-Length`` checked first (411, 413), then read within its deadline."""
        if self.headers.get("Transfer-Encoding"):
            raise RequestError(None, "chunked request bodies are not supported; send Content-Length", status=411)
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            raise RequestError(None, "a Content-Length header is required", status=411)
        limit = self.server.app.max_body_bytes
        if int(length) > limit:
            raise RequestError(None, f"the body is {length} bytes, more than {limit}", status=413)
        return self._read_within_deadline(int(length))

    def json_body(self) -> Any:
        raw = self.body()
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise RequestError(None, f"the body is not valid JSON: {exc}") from None

    def _read_within_deadline(self, length: int) -> bytes:
        """``length`` body bytes, within `HardenedServer.request_deadline_s`; short (cut or closed): `TimeoutError`."""
        app = self.server.app
        app.watchdog.arm(self.connection, app.request_deadline_s(length))
        try:
            raw = self.rfile.read(length)
        finally:
            app.watchdog.disarm(self.connection)
        if len(raw) < length:
            self.close_connection = True
            raise TimeoutError
        self.body_read = True
        return raw

    # -- answers -----------------------------------------------------------------------------------------------------
    def respond(self, status: int, body: Any, headers: dict[str, str]) -> None:
        """Write a route's answer (``body`` as JSON)."""
        self.send_json(status, body, headers)

    def send_json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 503:
                self.send_header("Retry-After", "1")
            if status == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="vlmreg"')
            for key, value in (headers or {}).items():
                if not (status == 503 and key.lower() == "retry-after"):
                    self.send_header(key, value)
            if self.close_connection:  # a refused body is not read: say that this connection ends here
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client went away; nothing to answer
            self.close_connection = True


class HardenedServer:
    """An HTTP server bound to ``host:port`` (0: a free port) with the module's bounds; subclasses give `route` (and
    `error_body` when their errors are not OpenAI's), and ``handler``: their `HardenedHandler` subclass."""

    open_paths: frozenset[str] = frozenset({"/health"})  # answered without the API key

    def __init__(
        self,
        host: str,
        port: int,
        *,
        handler: type[HardenedHandler],
        api_key: str | None = None,
        insecure_no_api_key: bool = False,
        max_connections: int,
        max_handlers: int,
        read_timeout_s: float,
        idle_timeout_s: float,
        max_body_bytes: int,
        log: Log | None = None,
        name: str,
    ) -> None:
        if api_key is None and not insecure_no_api_key and not is_loopback(host):
            raise VlmregError(
                f"listening on {host} without an API key would let anyone who reaches it use the server; pass api_key= "
                "(the CLI's --api-key-file), or insecure_no_api_key=True to accept that risk"
            )
        for key, value in (
            ("max_connections", max_connections),
            ("max_handlers", max_handlers),
            ("max_body_bytes", max_body_bytes),
        ):
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise VlmregError(f"{key} ({value!r}) must be a positive integer")
        for key, seconds in (("read_timeout_s", read_timeout_s), ("idle_timeout_s", idle_timeout_s)):
            if not 0 < seconds < math.inf:
                raise VlmregError(f"{key} ({seconds}) must be a positive number of seconds")
        self.api_key = check_key(api_key, "the server's API key") if api_key is not None else None
        self.read_timeout_s, self.idle_timeout_s, self.max_body_bytes = read_timeout_s, idle_timeout_s, max_body_bytes
        self.log, self.name = log, name
        self.watchdog = Watchdog()
        cls = _HTTPServer6 if ":" in host else _HTTPServer
        try:
            self._http = cls((host, port), handler)
        except OSError as exc:
            raise VlmregError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self._http.app = self
        self.admission = Admission(
            self._http.handle_connection,
            max_connections=max_connections,
            max_handlers=max_handlers,
            idle_s=lambda: self.idle_timeout_s,
            head_s=lambda: self.read_timeout_s,
            body_s=self.request_deadline_s,
            refusal_body=lambda message: self.error_body(
                RequestError(None, message, status=503, kind="server_error", code="overloaded")
            ),
            name=name,
        )
        self._thread: threading.Thread | None = None
        self._serving = threading.Event()

    # -- what a subclass gives ---------------------------------------------------------------------------------------
    def route(self, request: HardenedHandler, method: str, path: str) -> tuple[int, Any]:
        """The answer to one request whose key was checked: ``(status, body)``, or a `RequestError`."""
        raise NotImplementedError

    def error_body(self, error: RequestError) -> dict[str, Any]:
        """The JSON body of a refusal (OpenAI's error object unless a subclass says otherwise)."""
        return error.body()

    # -- the bounds ----------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def request_deadline_s(self, body_bytes: int) -> float:
        """How long a body of ``body_bytes`` may take to arrive: ``read_timeout_s`` plus its length at
        `MIN_BODY_RATE`."""
        return self.read_timeout_s + body_bytes / MIN_BODY_RATE

    @property
    def max_connections(self) -> int:
        return self.admission.max_connections

    @property
    def max_handlers(self) -> int:
        return self.admission.max_handlers

    # -- running
    # ---------------------------------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Answer requests on this thread until `close` (from another thread)."""
        self._serving.set()
        try:
            self._http.serve_forever(poll_interval=0.1)
        finally:
            self._serving.clear()

    def serve_in_background(self) -> str:
        """Answer requests on a background thread; returns the URL."""
        self._thread = threading.Thread(target=self.serve_forever, name=f"{self.name}-http", daemon=True)
        self._thread.start()
        self._serving.wait(5)
        return self.url

    def wait(self) -> None:
        """Block until the background thread ends (`close`); Ctrl-C reaches the caller."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.5)

    def stop_accepting(self) -> None:
        """Stop answering new requests (`serve_forever` returns)."""
        if self._serving.is_set():
            self._http.shutdown()

    def release(self) -> None:
        """Close every connection not on a handler and the listening socket."""
        self.watchdog.stop()
        self.admission.close()
        self._http.server_close()

    def close(self) -> None:
        self.stop_accepting()
        self.release()
