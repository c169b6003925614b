"""`vlmreg serve`: the model a run config describes, behind an OpenAI-compatible HTTP API (stdlib only).

``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /health``. Connections are handled on threads
of a `ThreadingHTTPServer`; each parses and checks its request (images decoded there), then queues it for
the one `BatchWorker` thread that owns the model, so concurrent clients share batches. A bad request is a
400 naming the field, a failure is a 500 with a one-line message; never a traceback, and the server goes on.
"""

from __future__ import annotations

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

from vlmreg import __version__
from vlmreg.config.resolve import ResolvedConfig
from vlmreg.config.schema import RunConfig
from vlmreg.data.images import ImageLimits
from vlmreg.data.prompts import vision_token_ids
from vlmreg.loading.load import LoadedModel, load
from vlmreg.sdk.errors import VlmregError
from vlmreg.serve.protocol import RequestError, ServeLimits, chat_response, parse_chat_request
from vlmreg.serve.weights import WeightUpdates
from vlmreg.serve.worker import BatchWorker

__all__ = ["MAX_BODY_BYTES", "Server", "serve_in_thread"]

MAX_BODY_BYTES = 256 << 20  # a request body larger than this is refused (413) before it is read
ROUTES = {"/health": "GET", "/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/weights": "POST"}
Log = Callable[[str], None]


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    app: Server


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = f"vlmreg/{__version__}"

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
        try:
            status, body = self._route(app, method)
        except RequestError as exc:
            status, body = exc.status, exc.body()
        except Exception as exc:  # a bug: one line to the client, the traceback to the server's log only
            if app.log is not None:
                app.log(traceback.format_exc())
            message = f"internal error: {type(exc).__name__}: {exc}"
            status, body = 500, {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
        self._send(status, body)

    def _route(self, app: Server, method: str) -> tuple[int, dict[str, Any]]:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
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
            model = {"id": limits.model_name, "object": "model", "created": app.started, "owned_by": "vlmreg"}
            return 200, {"object": "list", "data": [model]}
        if path == "/v1/weights":
            assert app.weights is not None
            return 200, app.weights.update(self._json_body())
        request = parse_chat_request(self._json_body(), limits)
        answer = worker.submit(request).result()
        return 200, chat_response(request, answer, limits.model_name)

    def _json_body(self) -> Any:
        if self.headers.get("Transfer-Encoding"):
            raise RequestError(None, "chunked request bodies are not supported; send Content-Length", status=411)
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            raise RequestError(None, "a Content-Length header is required", status=411)
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(None, f"the body is {length} bytes, more than {MAX_BODY_BYTES}", status=413)
        raw = self.rfile.read(int(length))
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
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client went away; nothing to answer
            pass


class Server:
    """An HTTP server bound to ``host:port`` (0: a free port); `attach` a loaded model to start serving it.

    Until a model is attached, ``/health`` answers 503 ``{"status": "loading"}`` and the API 503, so a
    process that starts ``vlmreg serve`` can poll ``/health``.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, *, log: Log | None = None) -> None:
        cls = _HTTPServer6 if ":" in host else _HTTPServer
        try:
            self._http = cls((host, port), _Handler)
        except OSError as exc:
            raise VlmregError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self._http.app = self
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

    @property
    def ready(self) -> bool:
        return self.worker is not None

    def attach(self, loaded: LoadedModel) -> None:
        """Serve ``loaded``'s model: start the worker thread; sampling suppresses the family's vision tokens."""
        if self.worker is not None:
            raise VlmregError("a model is already attached to this server")
        config, descriptor = loaded.config.config, loaded.resolved.descriptor
        name = config.model.name or f"{descriptor.name}-{config.model.size}-random"
        images = descriptor.max_images_per_message if descriptor.supports_vision else 0
        limits = ServeLimits(name, config.rollout.max_tokens, config.rollout.max_concurrent_rollouts, images, ImageLimits.from_section(config.data))
        worker = BatchWorker(
            loaded.model, loaded.processor, loaded.device, max_batch=config.rollout.max_concurrent_rollouts,
            suppress_token_ids=vision_token_ids(loaded.processor, descriptor), descriptor=descriptor,
        )
        worker.start()
        self.limits, self.worker = limits, worker
        self.weights = WeightUpdates(loaded, worker.between_batches)

    def receive_weights_from(self, host: str, port: int, *, rank: int = 1, backend: str = "gloo", timeout_s: float = 120.0) -> None:
        """Join the trainer's weight process group (its `Sender` listens at ``host:port``) for ``POST /v1/weights``."""
        from vlmreg.broadcast import Receiver

        if self.weights is None:
            raise VlmregError("attach a model before joining a weight process group")
        loaded = self.weights.loaded
        self.weights.receiver = Receiver(loaded.resolved, host=host, port=port, rank=rank, backend=backend, device=loaded.device, timeout_s=timeout_s)
        self.weights.timeout_s = timeout_s

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
        self._http.server_close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_in_thread(
    config_or_loaded: LoadedModel | RunConfig | ResolvedConfig | str | Path, host: str = "127.0.0.1", port: int = 0, *, log: Log | None = None
) -> tuple[Server, str]:
    """Load the model (unless given loaded), serve it on a background thread; returns the server and its URL."""
    loaded = config_or_loaded if isinstance(config_or_loaded, LoadedModel) else load(config_or_loaded)
    server = Server(host, port, log=log)
    server.attach(loaded)
    return server, server.start()
