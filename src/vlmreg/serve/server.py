"""`vlmreg serve`: the model a run config describes, behind an OpenAI-compatible HTTP API (stdlib only).

``POST /v1/chat/completions`` (JSON, or Server-Sent Events with ``stream: true``), ``GET /v1/models``,
``GET /v1/models/{id}`` and ``GET /health``. `Server` is a `vlmreg.http.server.HardenedServer`: that base receives
each request without a thread until it has arrived, caps the open connections (``max_connections``) and the handler
threads (``max_handlers``), bounds each client in time (``idle_timeout_s`` for a request to start, ``read_timeout_s``
for every read and write and, as deadlines, for the request line and headers and for the body plus its length at
256 KiB/s) and in size (a body of at most `MAX_BODY_BYTES`, refused with 413 before it is read), and checks the API
key before any route runs. A handler takes a request that has arrived, parses and checks it (images decoded there),
then queues it for the one `BatchWorker` thread that owns the model, so concurrent clients share batches; at most
``max_queued`` requests wait for the model. A bad request is a 400 naming the field, a failure a 500 with a one-line
message; never a traceback, and the server goes on. Past any cap the answer is a 503 with ``Retry-After``.

With an API key (``api_key``), every request but ``GET /health`` must carry ``Authorization: Bearer KEY``, else
a 401 with ``WWW-Authenticate: Bearer``. ``POST /v1/weights`` replaces the served model's weights, so it is
refused (403) unless the server has a key or was started to take a trainer's syncs (``allow_weights``); a weights
directory (``path``) must lie under ``weights_dir``, and the payload is checked (complete, finite, a step not older
than the last) before anything is applied (`vlmreg.serve.weights`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from vlmreg.broadcast.plan import served_lora
from vlmreg.config.resolve import ResolvedConfig
from vlmreg.config.schema import RunConfig
from vlmreg.data.datasets import run_video_sampling
from vlmreg.data.images import ImageLimits
from vlmreg.data.prompts import vision_token_ids
from vlmreg.data.video import VideoLimits
from vlmreg.http.server import LISTEN_BACKLOG, MIN_BODY_RATE, HardenedHandler, HardenedServer
from vlmreg.loading.load import LoadedModel, load
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_transport_registry
from vlmreg.sdk.transport import ReceiverContext
from vlmreg.sdk.version import __version__
from vlmreg.serve.protocol import RequestError, ServeLimits, chat_response, parse_chat_request
from vlmreg.serve.streaming import DONE, sse, stream_chunks
from vlmreg.serve.weights import WeightUpdates
from vlmreg.serve.worker import DEFAULT_MAX_QUEUED, BatchWorker

__all__ = ["LISTEN_BACKLOG", "MAX_BODY_BYTES", "MIN_BODY_RATE", "Server", "serve_in_thread"]

MAX_BODY_BYTES = 256 << 20  # a request body larger than this is refused (413) before it is read
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_HANDLERS = 256  # handler threads; raised to the model's batch size when a model is attached
DEFAULT_READ_TIMEOUT_S = 60.0
DEFAULT_IDLE_TIMEOUT_S = 5.0  # as vLLM's HTTP keep-alive timeout (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
ROUTES = {"/health": "GET", "/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/weights": "POST"}
MODELS = "/v1/models/"
Log = Callable[[str], None]


class _Handler(HardenedHandler):
    server_version = f"vlmreg/{__version__}"

    def respond(self, status: int, body: Any, headers: dict[str, str]) -> None:
        if isinstance(body, list):
            self._send_events(body)
        else:
            self.send_json(status, body, headers)

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


class Server(HardenedServer):
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
        if not (isinstance(max_queued, int) and not isinstance(max_queued, bool) and max_queued > 0):
            raise VlmregError(f"max_queued ({max_queued!r}) must be a positive integer")
        super().__init__(
            host,
            port,
            handler=_Handler,
            api_key=api_key,
            insecure_no_api_key=insecure_no_api_key,
            max_connections=max_connections,
            max_handlers=max_handlers,
            read_timeout_s=read_timeout_s,
            idle_timeout_s=idle_timeout_s,
            max_body_bytes=MAX_BODY_BYTES,
            log=log,
            name="vlmreg-serve",
        )
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.allow_weights, self.max_queued = allow_weights, max_queued
        self.started = int(time.time())
        self.worker: BatchWorker | None = None
        self.weights: WeightUpdates | None = None
        # module -> {"r", "scaling"}: LoRA this server serves as adapters
        self.loaded_lora: dict[str, dict[str, Any]] | None = None
        self.limits: ServeLimits | None = None

    # -- the routes ------------------------------------------------------------------------------
    def route(self, request: HardenedHandler, method: str, path: str) -> tuple[int, Any]:
        if path.startswith(MODELS) and method == "GET":
            return self._model(unquote(path[len(MODELS) :]))
        if path not in ROUTES:
            raise RequestError(
                None, f"no route {path} (routes: {', '.join(ROUTES)})", status=404, kind="not_found_error"
            )
        if ROUTES[path] != method:
            raise RequestError(None, f"{path} takes {ROUTES[path]}, not {method}", status=405)
        if path == "/health":
            step = self.weights.step if self.weights is not None else None
            return (200, {"status": "ok", "weights_step": step}) if self.ready else (503, {"status": "loading"})
        limits, worker = self.limits, self.worker
        if limits is None or worker is None:
            raise RequestError(
                None, "the model is still loading; retry when GET /health answers 200", status=503, kind="server_error"
            )
        if path == "/v1/models":
            return 200, {"object": "list", "data": [self.model_card()]}
        if path == "/v1/weights":
            assert self.weights is not None
            if self.api_key is None and not self.allow_weights:
                request.drain()
                raise RequestError(
                    None,
                    "POST /v1/weights is off: it replaces the served model's weights, so it needs a server started "
                    "with an API key (--api-key-file or VLMREG_API_KEY) or for training (--weights-from)",
                    status=403,
                    kind="permission_error",
                    code="weights_disabled",
                )
            return 200, self.weights.update(request.json_body())
        chat = parse_chat_request(request.json_body(), limits)
        answer = worker.submit(chat).result()
        if chat.stream:
            return 200, list(stream_chunks(chat, answer, limits.model_name))
        return 200, chat_response(chat, answer, limits.model_name)

    def _model(self, name: str) -> tuple[int, dict[str, Any]]:
        limits = self.limits
        if limits is None:
            raise RequestError(
                None, "the model is still loading; retry when GET /health answers 200", status=503, kind="server_error"
            )
        if name != limits.model_name:
            raise RequestError(
                "model",
                f"the model {name!r} does not exist; this server serves {limits.model_name!r}",
                status=404,
                code="model_not_found",
            )
        return 200, self.model_card()

    @property
    def ready(self) -> bool:
        return self.worker is not None

    def model_card(self) -> dict[str, Any]:
        """The served model as ``GET /v1/models`` lists it."""
        assert self.limits is not None
        card = {"id": self.limits.model_name, "object": "model", "created": self.started, "owned_by": "vlmreg"}
        if self.loaded_lora:  # the adapters this server takes as adapters (a trainer sends those unmerged)
            card["vlmreg_lora"] = self.loaded_lora
        return card

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
        vocab = (
            head.weight.shape[0]
            if head is not None
            else getattr(getattr(loaded.model.config, "text_config", loaded.model.config), "vocab_size", None)
        )
        image_limits = ImageLimits.from_section(config.data)
        limits = ServeLimits(
            name,
            config.rollout.max_tokens,
            config.rollout.max_concurrent_rollouts,
            images,
            image_limits,
            vocab,
            family=descriptor.name,
            thinking_markers=bool(descriptor.thinking_start and descriptor.thinking_end),
            max_videos_per_message=descriptor.max_videos_per_message if descriptor.supports_vision else 0,
            videos=VideoLimits.from_section(config.data, image_limits),
            video_sampling=run_video_sampling(config.data, descriptor.video_sampling),
        )
        self.loaded_lora = served_lora(loaded.resolved) or None
        worker = BatchWorker(
            loaded.resolved.model,
            loaded.processor,
            loaded.device,
            max_batch=config.rollout.max_concurrent_rollouts,
            suppress_token_ids=vision_token_ids(loaded.processor, descriptor),
            descriptor=descriptor,
            max_queued=self.max_queued,
        )
        worker.start()
        self.admission.max_handlers = max(self.admission.max_handlers, limits.max_n)
        self.limits, self.worker = limits, worker
        self.weights = WeightUpdates(loaded, worker.between_batches, weights_dir=self.weights_dir)

    def receive_weights_from(
        self, host: str, port: int, *, rank: int = 1, backend: str = "gloo", timeout_s: float = 120.0
    ) -> None:
        """Join the trainer's weight process group (its `Sender` listens at ``host:port``) for ``POST /v1/weights``."""
        self.receive_weights_with(backend, {"host": host, "port": str(port), "rank": str(rank)}, timeout_s=timeout_s)

    def receive_weights_with(self, transport: str, options: dict[str, str], *, timeout_s: float = 120.0) -> None:
        """Take ``POST /v1/weights`` syncs through the receiver of the registered ``transport``, built with
        ``options``."""

        if self.weights is None:
            raise VlmregError("attach a model before joining a weight process group")
        spec = get_transport_registry().get(transport)
        if spec.receiver is None:
            raise VlmregError(
                f"transport {transport!r} has no vlmreg serve end (it works with: "
                f"{', '.join(spec.servers) or 'no server'})"
            )
        self.allow_weights = True
        self.weights.joined.clear()  # a sync that arrives while the join finishes waits for it (no 409 race)
        try:
            self.weights.add(
                spec.receiver(ReceiverContext(loaded=self.weights.loaded, options=dict(options), timeout_s=timeout_s))
            )
            self.weights.timeout_s = timeout_s
        finally:
            self.weights.joined.set()

    def between_batches(self, fn: Callable[[Any], Any]) -> Future[Any]:
        """Run ``fn(model)`` on the model's thread between two batches (see `BatchWorker.between_batches`)."""
        if self.worker is None:
            raise VlmregError("no model is attached to this server yet")
        return self.worker.between_batches(fn)

    def start(self) -> str:
        """Answer requests on a background thread; returns the URL."""
        return self.serve_in_background()

    def close(self) -> None:
        """Stop answering, let the batch in progress finish, answer queued requests 503, release the port."""
        self.stop_accepting()
        if self.worker is not None:
            self.worker.stop()
        self.release()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_in_thread(
    config_or_loaded: LoadedModel | RunConfig | ResolvedConfig | str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    log: Log | None = None,
    api_key: str | None = None,
    allow_weights: bool = False,
    weights_dir: str | Path | None = None,
) -> tuple[Server, str]:
    """Load the model (unless given loaded), serve it on a background thread; returns the server and its URL."""
    loaded = config_or_loaded if isinstance(config_or_loaded, LoadedModel) else load(config_or_loaded)
    server = Server(host, port, log=log, api_key=api_key, allow_weights=allow_weights, weights_dir=weights_dir)
    server.attach(loaded)
    return server, server.start()
