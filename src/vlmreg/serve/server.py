"""`vlmreg serve`: the model a run config describes, behind an OpenAI-compatible HTTP API (stdlib only).

``POST /v1/chat/completions`` (JSON, or Server-Sent Events with ``stream: true``), ``GET /v1/models``,
``GET /v1/models/{id}`` and ``GET /health``. Connections are accepted by a `ThreadingHTTPServer` (a listen
backlog of `LISTEN_BACKLOG`, so a burst of clients waits to be accepted rather than being reset) and handed to
`Admission` (`vlmreg.serve.connections`), which receives each request on one thread without blocking, so a client
that stalls or idles holds no thread, and caps the open connections and the handler threads. A handler takes a
request that has arrived, parses and checks it (images decoded there), then queues it for the one `BatchWorker`
thread that owns the model, so concurrent clients share batches. A bad request is a 400 naming the field, a
failure is a 500 with a one-line message; never a traceback, and the server goes on.

Each client is bounded: a body of at most `MAX_BODY_BYTES` (refused, 413, from its ``Content-Length`` before any
of it is read), the stdlib's header limits (100 headers, 64 KiB a line: 431, or 414 for the request line),
``idle_timeout_s`` for a request to start (on a new or a kept-alive connection), ``read_timeout_s`` for every read
and write on its socket and, as deadlines, for the request line and headers together and for the body (plus its
length at `MIN_BODY_RATE`), so a client that drips bytes is cut off too. At most ``max_connections`` connections
are open at once, at most ``max_handlers`` requests are on a handler thread (the others wait, holding no thread, up
to ``read_timeout_s``), and at most ``max_queued`` requests wait for the model; past any of these the answer is a
503 with ``Retry-After``.

With an API key (``api_key``), every request but ``GET /health`` must carry ``Authorization: Bearer KEY``, else
a 401 with ``WWW-Authenticate: Bearer``. ``POST /v1/weights`` replaces the served model's weights, so it is
refused (403) unless the server has a key or was started to take a trainer's syncs (``allow_weights``); a weights
directory (``path``) must lie under ``weights_dir``, and the payload is checked (complete, finite, a step not older
than the last) before anything is applied (`vlmreg.serve.weights`).
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from vlmreg import __version__
from vlmreg.config.resolve import ResolvedConfig
from vlmreg.config.schema import RunConfig
from vlmreg.data.images import ImageLimits
from vlmreg.data.prompts import vision_token_ids
from vlmreg.loading.load import LoadedModel, load
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_transport_registry
from vlmreg.sdk.transport import ReceiverContext
from vlmreg.serve.auth import bearer_matches, check_key, is_loopback
from vlmreg.serve.connections import DRAIN_LIMIT, Admission, Replay, Watchdog
from vlmreg.serve.protocol import RequestError, ServeLimits, chat_response, parse_chat_request
from vlmreg.serve.streaming import DONE, sse, stream_chunks
from vlmreg.serve.weights import WeightUpdates
from vlmreg.serve.worker import DEFAULT_MAX_QUEUED, BatchWorker

__all__ = ["LISTEN_BACKLOG", "MAX_BODY_BYTES", "Server", "serve_in_thread"]

MAX_BODY_BYTES = 256 << 20  # a request body larger than this is refused (413) before it is read
LISTEN_BACKLOG = 1024  # connections the kernel holds until accepted (the stdlib's 5 resets bursts of clients)
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_HANDLERS = 256  # handler threads; raised to the model's batch size when a model is attached
DEFAULT_READ_TIMEOUT_S = 60.0
DEFAULT_IDLE_TIMEOUT_S = 5.0  # as vLLM's HTTP keep-alive timeout (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
MIN_BODY_RATE = 256 << 10  # bytes/s: a body must arrive within read_timeout_s + its length at this rate
ROUTES = {"/health": "GET", "/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/weights": "POST"}
MODELS = "/v1/models/"
Log = Callable[[str], None]


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    app: Server

    def process_request(self, request: Any, client_address: Any) -> None:
        """Hand the accepted connection to `Admission`: a handler thread, a place in line, or a 503; never a thread each."""
        self.app.admission.admit(request, client_address)

    def handle_connection(self, request: Any, client_address: Any, received: bytes) -> None:
        """Serve one connection (``received``: what `Admission` already read of it) to its end on the calling
        (handler) thread, then close it; never raises."""
        try:
            _Handler(request, client_address, self, received)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = f"vlmreg/{__version__}"

    def __init__(self, request: Any, client_address: Any, server: _HTTPServer, received: bytes = b"") -> None:
        self.received = received  # read by `Admission` before this handler took the connection
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        self.timeout = self.server.app.read_timeout_s  # every read and write on this connection
        super().setup()
        if self.received:
            self.rfile = io.BufferedReader(Replay(self.received, self.rfile))

    def handle_one_request(self) -> None:
        """A request must start within ``idle_timeout_s``; its line and headers must all arrive within ``read_timeout_s``."""
        if not self._request_starts(self.server.app.idle_timeout_s):
            self.close_connection = True
            return
        watchdog = self.server.app.watchdog
        watchdog.arm(self.connection, self.server.app.read_timeout_s)
        try:
            super().handle_one_request()
        finally:
            watchdog.disarm(self.connection)

    def _request_starts(self, idle_timeout_s: float) -> bool:
        """Whether a request's first byte arrives (or was already read) within ``idle_timeout_s``."""
        self.connection.settimeout(min(idle_timeout_s, self.timeout))
        try:
            return bool(self.rfile.peek(1))  # type: ignore[attr-defined]
        except OSError:  # TimeoutError included: an idle connection is closed
            return False
        finally:
            self.connection.settimeout(self.timeout)

    def _read_within_deadline(self, length: int) -> bytes:
        """``length`` body bytes, within `Server.request_deadline_s`; short (cut or closed): `TimeoutError`."""
        watchdog = self.server.app.watchdog
        watchdog.arm(self.connection, self.server.app.request_deadline_s(length))
        try:
            raw = self.rfile.read(length)
        finally:
            watchdog.disarm(self.connection)
        if len(raw) < length:
            self.close_connection = True
            raise TimeoutError
        return raw

    def log_message(self, format: str, *args: Any) -> None:
        log = self.server.app.log
        if log is not None:
            log(f"{self.address_string()} {format % args}")

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def _answer(self, method: str) -> None:
        app = self.server.app
        app.watchdog.disarm(self.connection)  # the headers are in; the body has its own deadline, the model none
        try:
            status, body = self._route(app, method)
        except RequestError as exc:
            status, body = exc.status, exc.body()
        except TimeoutError:  # the client stopped sending: drop the connection
            self.close_connection = True
            return
        except Exception as exc:  # a bug: one line to the client, the traceback to the server's log only
            if app.log is not None:
                app.log(traceback.format_exc())
            message = f"internal error: {type(exc).__name__}: {exc}"
            status, body = 500, {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
        if isinstance(body, list):
            self._send_events(body)
        else:
            self._send(status, body)

    def _route(self, app: Server, method: str) -> tuple[int, Any]:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        if app.api_key is not None and path != "/health" and not bearer_matches(self.headers.get("Authorization"), app.api_key):
            self._drain()
            missing = not self.headers.get("Authorization")
            message = ("no API key: send the server's key as 'Authorization: Bearer KEY'" if missing
                       else "the API key is not this server's (send 'Authorization: Bearer KEY')")
            raise RequestError(None, message, status=401, code="invalid_api_key")
        if path.startswith(MODELS) and method == "GET":
            return self._model(app, unquote(path[len(MODELS) :]))
        if path not in ROUTES:
            raise RequestError(None, f"no route {path} (routes: {', '.join(ROUTES)})", status=404, kind="not_found_error")
        if ROUTES[path] != method:
            raise RequestError(None, f"{path} takes {ROUTES[path]}, not {method}", status=405)
        if path == "/health":
            step = app.weights.step if app.weights is not None else None
            return (200, {"status": "ok", "weights_step": step}) if app.ready else (503, {"status": "loading"})
        limits, worker = app.limits, app.worker
        if limits is None or worker is None:
            raise RequestError(None, "the model is still loading; retry when GET /health answers 200", status=503, kind="server_error")
        if path == "/v1/models":
            return 200, {"object": "list", "data": [app.model_card()]}
        if path == "/v1/weights":
            assert app.weights is not None
            if app.api_key is None and not app.allow_weights:
                self._drain()
                raise RequestError(
                    None, "POST /v1/weights is off: it replaces the served model's weights, so it needs a server started with "
                    "an API key (--api-key-file or VLMREG_API_KEY) or for training (--weights-from)", status=403, kind="permission_error",
                    code="weights_disabled",
                )
            return 200, app.weights.update(self._json_body())
        request = parse_chat_request(self._json_body(), limits)
        answer = worker.submit(request).result()
        if request.stream:
            return 200, list(stream_chunks(request, answer, limits.model_name))
        return 200, chat_response(request, answer, limits.model_name)

    def _model(self, app: Server, name: str) -> tuple[int, dict[str, Any]]:
        limits = app.limits
        if limits is None:
            raise RequestError(None, "the model is still loading; retry when GET /health answers 200", status=503, kind="server_error")
        if name != limits.model_name:
            raise RequestError("model", f"the model {name!r} does not exist; this server serves {limits.model_name!r}", status=404, code="model_not_found")
        return 200, app.model_card()

    def _drain(self) -> None:
        """Read and drop a small body, so closing the connection does not reset it under the answer."""
        length = self.headers.get("Content-Length", "")
        self.close_connection = True
        if length.isdigit() and int(length) <= DRAIN_LIMIT:
            try:
                self._read_within_deadline(int(length))
            except OSError:  # TimeoutError included: nothing more to read
                pass

    def _json_body(self) -> Any:
        if self.headers.get("Transfer-Encoding"):
            raise RequestError(None, "chunked request bodies are not supported; send Content-Length", status=411)
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            raise RequestError(None, "a Content-Length header is required", status=411)
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(None, f"the body is {length} bytes, more than {MAX_BODY_BYTES}", status=413)
        raw = self._read_within_deadline(int(length))
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise RequestError(None, f"the body is not valid JSON: {exc}") from None

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 503:
                self.send_header("Retry-After", "1")
            if status == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="vlmreg"')
            if self.close_connection:  # a refused body is not read: say that this connection ends here
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client went away; nothing to answer
            self.close_connection = True

    def _send_events(self, chunks: list[dict[str, Any]]) -> None:
        """A Server-Sent Events answer: each chunk, then ``[DONE]``; the end of the body is the connection's close."""
        self.close_connection = True
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(sse(chunk))
            self.wfile.write(DONE)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass


class Server:
    """An HTTP server bound to ``host:port`` (0: a free port); `attach` a loaded model to start serving it.

    Until a model is attached, ``/health`` answers 503 ``{"status": "loading"}`` and the API 503, so a
    process that starts ``vlmreg serve`` can poll ``/health``.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        log: Log | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_queued: int = DEFAULT_MAX_QUEUED,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        max_handlers: int = DEFAULT_MAX_HANDLERS,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        api_key: str | None = None,
        allow_weights: bool = False,
        weights_dir: str | Path | None = None,
        insecure_no_api_key: bool = False,
    ) -> None:
        if api_key is None and not insecure_no_api_key and not is_loopback(host):
            raise VlmregError(
                f"listening on {host} without an API key would let anyone who reaches it use the server; pass api_key= "
                "(the CLI's --api-key-file), or insecure_no_api_key=True to accept that risk"
            )
        for key, value in (("max_connections", max_connections), ("max_queued", max_queued), ("max_handlers", max_handlers)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise VlmregError(f"{key} ({value!r}) must be a positive integer")
        for key, value in (("read_timeout_s", read_timeout_s), ("idle_timeout_s", idle_timeout_s)):
            if not 0 < value < float("inf"):
                raise VlmregError(f"{key} ({value}) must be a positive number of seconds")
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.api_key = check_key(api_key, "the server's API key") if api_key is not None else None
        self.allow_weights = allow_weights
        self.max_queued, self.read_timeout_s, self.idle_timeout_s = max_queued, read_timeout_s, idle_timeout_s
        self.watchdog = Watchdog()
        cls = _HTTPServer6 if ":" in host else _HTTPServer
        try:
            self._http = cls((host, port), _Handler)
        except OSError as exc:
            raise VlmregError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self._http.app = self
        self.admission = Admission(
            self._http.handle_connection, max_connections=max_connections, max_handlers=max_handlers,
            idle_s=lambda: self.idle_timeout_s, head_s=lambda: self.read_timeout_s, body_s=self.request_deadline_s,
        )
        self.log = log
        self.started = int(time.time())
        self.worker: BatchWorker | None = None
        self.weights: WeightUpdates | None = None
        self.limits: ServeLimits | None = None
        self._thread: threading.Thread | None = None
        self._serving = threading.Event()

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}"

    def request_deadline_s(self, body_bytes: int) -> float:
        """How long a body of ``body_bytes`` may take to arrive: ``read_timeout_s`` plus its length at `MIN_BODY_RATE`."""
        return self.read_timeout_s + body_bytes / MIN_BODY_RATE

    @property
    def max_connections(self) -> int:
        return self.admission.max_connections

    @property
    def max_handlers(self) -> int:
        return self.admission.max_handlers

    @property
    def ready(self) -> bool:
        return self.worker is not None

    def model_card(self) -> dict[str, Any]:
        """The served model as ``GET /v1/models`` lists it."""
        assert self.limits is not None
        return {"id": self.limits.model_name, "object": "model", "created": self.started, "owned_by": "vlmreg"}

    def attach(self, loaded: LoadedModel) -> None:
        """Serve ``loaded``'s model: start the worker thread; sampling suppresses the family's vision tokens.

        The handler threads are raised to at least the batch size (``rollout.max_concurrent_rollouts``), so a full
        batch of requests can wait for the model at once.
        """
        if self.worker is not None:
            raise VlmregError("a model is already attached to this server")
        config, descriptor = loaded.config.config, loaded.resolved.descriptor
        name = config.model.name or f"{descriptor.name}-{config.model.size}-random"
        images = descriptor.max_images_per_message if descriptor.supports_vision else 0
        head = loaded.model.get_output_embeddings()
        vocab = head.weight.shape[0] if head is not None else getattr(getattr(loaded.model.config, "text_config", loaded.model.config), "vocab_size", None)
        limits = ServeLimits(name, config.rollout.max_tokens, config.rollout.max_concurrent_rollouts, images, ImageLimits.from_section(config.data), vocab,
                             family=descriptor.name, thinking_markers=bool(descriptor.thinking_start and descriptor.thinking_end))
        worker = BatchWorker(
            loaded.model, loaded.processor, loaded.device, max_batch=config.rollout.max_concurrent_rollouts,
            suppress_token_ids=vision_token_ids(loaded.processor, descriptor), descriptor=descriptor, max_queued=self.max_queued,
        )
        worker.start()
        self.admission.max_handlers = max(self.admission.max_handlers, limits.max_n)
        self.limits, self.worker = limits, worker
        self.weights = WeightUpdates(loaded, worker.between_batches, weights_dir=self.weights_dir)

    def receive_weights_from(self, host: str, port: int, *, rank: int = 1, backend: str = "gloo", timeout_s: float = 120.0) -> None:
        """Join the trainer's weight process group (its `Sender` listens at ``host:port``) for ``POST /v1/weights``."""
        self.receive_weights_with(backend, {"host": host, "port": str(port), "rank": str(rank)}, timeout_s=timeout_s)

    def receive_weights_with(self, transport: str, options: dict[str, str], *, timeout_s: float = 120.0) -> None:
        """Take ``POST /v1/weights`` syncs through the receiver of the registered ``transport``, built with ``options``."""

        if self.weights is None:
            raise VlmregError("attach a model before joining a weight process group")
        spec = get_transport_registry().get(transport)
        if spec.receiver is None:
            raise VlmregError(f"transport {transport!r} has no vlmreg serve end (it works with: {', '.join(spec.servers) or 'no server'})")
        self.allow_weights = True
        self.weights.joined.clear()  # a sync that arrives while the join finishes waits for it (no 409 race)
        try:
            self.weights.add(spec.receiver(ReceiverContext(loaded=self.weights.loaded, options=dict(options), timeout_s=timeout_s)))
            self.weights.timeout_s = timeout_s
        finally:
            self.weights.joined.set()

    def between_batches(self, fn: Callable[[Any], Any]) -> Future[Any]:
        """Run ``fn(model)`` on the model's thread between two batches (see `BatchWorker.between_batches`)."""
        if self.worker is None:
            raise VlmregError("no model is attached to this server yet")
        return self.worker.between_batches(fn)

    def serve_forever(self) -> None:
        """Answer requests on this thread until `close` (from another thread)."""
        self._serving.set()
        try:
            self._http.serve_forever(poll_interval=0.1)
        finally:
            self._serving.clear()

    def start(self) -> str:
        """Answer requests on a background thread; returns the URL."""
        self._thread = threading.Thread(target=self.serve_forever, name="vlmreg-serve-http", daemon=True)
        self._thread.start()
        self._serving.wait(5)
        return self.url

    def wait(self) -> None:
        """Block until the background thread ends (`close`); Ctrl-C reaches the caller."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.5)

    def close(self) -> None:
        """Stop answering, let the batch in progress finish, answer queued requests 503, release the port."""
        if self._serving.is_set():
            self._http.shutdown()
        if self.worker is not None:
            self.worker.stop()
        self.watchdog.stop()
        self.admission.close()
        self._http.server_close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_in_thread(
    config_or_loaded: LoadedModel | RunConfig | ResolvedConfig | str | Path, host: str = "127.0.0.1", port: int = 0, *, log: Log | None = None,
    api_key: str | None = None, allow_weights: bool = False, weights_dir: str | Path | None = None,
) -> tuple[Server, str]:
    """Load the model (unless given loaded), serve it on a background thread; returns the server and its URL."""
    loaded = config_or_loaded if isinstance(config_or_loaded, LoadedModel) else load(config_or_loaded)
    server = Server(host, port, log=log, api_key=api_key, allow_weights=allow_weights, weights_dir=weights_dir)
    server.attach(loaded)
    return server, server.start()
