"""The trainer's side of vLLM as a rollout server (`vlmreg.inference.vllm_server`), against a stand-in for vLLM 0.24.

The stand-in answers vLLM 0.24's dev-mode routes as its FastAPI app does (same paths, methods, bodies and status
codes; an engine error is vLLM's ``{"error": {"message", "type", "param", "code"}}``, an unknown route Starlette's
``{"detail": "Not Found"}``). Behind it, its "workers" are real spawned processes, each a stand-in for vLLM's GPU
worker (`_Worker` below follows ``vllm/v1/worker/gpu_worker.py``) that holds a real tiny Qwen3-VL model and takes
weights through the real `vlmreg.inference.vllm_worker` code: the weight-transfer engine that
`register_transfer_engine` registers (with vLLM's base classes, copied below, since vLLM cannot be installed here),
or the `VlmregWorkerExtension` methods through ``/collective_rpc``. Its ``load_weights`` maps checkpoint names back
with the family's ``memory_weights`` (`apply_weights`). Weights move over gloo, on CPU.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import types
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

import vlmreg
from tests.broadcast.helpers import assert_state_equal
from tests.broadcast.test_copy_plan import FusedModel, _Shared, checkpoint, reference, refill
from vlmreg.broadcast import WeightPlan, apply_weights, ipc
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.data import ImageStore
from vlmreg.data.prompts import PromptEncoder
from vlmreg.inference import vllm_server
from vlmreg.inference.cache_scope import CacheScope
from vlmreg.inference.openai_client import OpenAIEngine
from vlmreg.inference.vllm_rpc import RpcSyncs
from vlmreg.inference.vllm_server import VllmServer, export_checkpoint, vllm_command
from vlmreg.inference.vllm_worker import VlmregWorkerExtension, WeightIntake, register_transfer_engine
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_transport_registry

WORKERS = 2  # tensor parallel 2


def _config(family: str = "qwen3_vl") -> dict[str, Any]:
    return {"model": {"init": "random", "family": family}, "trainer": {"device": "cpu"}}


# -- vLLM's weight-transfer base classes, for the worker processes ---------------------------------------------------
# A copy of what `register_transfer_engine` uses from vllm/distributed/weight_transfer/{base,factory}.py (vLLM 0.24.0,
# Apache-2.0): the dataclass bases (the update info's keyword-only fields included), the engine base with its parsing,
# and the factory's registry.


_BASE = """
from abc import ABC, abstractmethod
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal


@dataclass
class WeightTransferInitInfo(ABC):
    pass


@dataclass
class WeightTransferUpdateInfo(ABC):
    _: KW_ONLY
    update_kind: Literal["dense", "sparse_flat"] = "dense"
    num_updates_list: list[int] | None = None

    def __post_init__(self) -> None:
        if self.update_kind not in ("dense", "sparse_flat"):
            raise ValueError(f"Unsupported update_kind: {self.update_kind}")
        if self.update_kind == "dense" and self.num_updates_list is not None:
            raise ValueError("Sparse metadata is only supported for `update_kind='sparse_flat'`")


class WeightTransferEngine(ABC):
    init_info_cls: type
    update_info_cls: type

    def __init__(self, config: Any, parallel_config: Any, model: Any) -> None:
        self.config, self.parallel_config, self.model = config, parallel_config, model

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        try:
            return self.init_info_cls(**init_dict)
        except TypeError as e:
            raise ValueError(f"Invalid init_info for {self.__class__.__name__}: {e}") from e

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        try:
            return self.update_info_cls(**update_dict)
        except TypeError as e:
            raise ValueError(f"Invalid update_info for {self.__class__.__name__}: {e}") from e

    @abstractmethod
    def init_transfer_engine(self, init_info: Any) -> None: ...

    @abstractmethod
    def receive_weights(self, update_info: Any, load_weights: Any) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    @staticmethod
    @abstractmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None: ...
"""

_FACTORY = """
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine


class WeightTransferEngineFactory:
    _registry: dict[str, Any] = {}

    @classmethod
    def register_engine(cls, name: str, engine_cls: type[WeightTransferEngine]) -> None:
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        cls._registry[name] = lambda: engine_cls

    @classmethod
    def create_engine(cls, config: Any, parallel_config: Any, model: Any) -> WeightTransferEngine:
        if config.backend not in cls._registry:
            available = list(cls._registry)
            raise ValueError(f"Invalid weight transfer backend: {config.backend}. Available engines: {available}")
        return cls._registry[config.backend]()(config, parallel_config, model)
"""


def _install_vllm_weight_transfer() -> None:
    """Make ``vllm.distributed.weight_transfer.{base,factory}`` importable (modules of their own, as in vLLM: the
    dataclasses are built without postponed annotations, so ``KW_ONLY`` works as it does there)."""

    sources = {"vllm.distributed.weight_transfer.base": _BASE, "vllm.distributed.weight_transfer.factory": _FACTORY}
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer", *sources):
        module = types.ModuleType(name)
        module.__spec__ = ModuleSpec(name, None, is_package=name not in sources)
        if name not in sources:
            module.__path__ = []
        sys.modules[name] = module
        if name in sources:
            exec(compile(sources[name], f"<{name} stand-in>", "exec", dont_inherit=True), module.__dict__)


# -- one worker process ----------------------------------------------------------------------------------------------


def _worker_main(rank: int, world_size: int, conn: Any) -> None:
    loaded = vlmreg.load(parse_config(_config()))
    resolved = loaded.resolved
    with torch.no_grad():  # weights of its own, so that only a sync can make them the trainer's
        generator = torch.Generator().manual_seed(1000 + rank)
        for parameter in resolved.model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))

    _install_vllm_weight_transfer()  # only in this process: the test process has no vllm
    # deferred: vllm is an optional extra
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: PLC0415

    assert register_transfer_engine(), "the vlmreg engine did not register with vLLM's weight-transfer factory"

    class Model:
        """What vLLM's model offers: ``load_weights`` over (checkpoint name, tensor) pairs."""

        def __init__(self) -> None:
            self.loads: list[list[str]] = []

        def load_weights(self, weights: Any) -> set[str]:
            pairs = list(weights)
            self.loads.append([name for name, _ in pairs])
            apply_weights(resolved, dict(pairs))  # names mapped back by the family's memory_weights
            return {name for name, _ in pairs}

    class Worker(VlmregWorkerExtension):  # vLLM mixes the extension into its worker class the same way
        """vllm/v1/worker/gpu_worker.py's weight-update methods, on CPU, without the layerwise reload itself."""

        def __init__(self) -> None:
            self.rank, self.device = rank, torch.device("cpu")
            self.parallel_config = SimpleNamespace(rank=rank, world_size=world_size, data_parallel_index=0)
            self.model_runner = SimpleNamespace(model=Model())
            self.weight_transfer_engine: Any = None
            self._weight_update_active, self._is_checkpoint_format = False, True

        def _check_weight_transfer_engine(self) -> None:
            if self.weight_transfer_engine is None:
                raise RuntimeError(
                    "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
                )

        def init_weight_transfer_engine(self, init_info: dict) -> None:
            self._check_weight_transfer_engine()
            self.weight_transfer_engine.init_transfer_engine(self.weight_transfer_engine.parse_init_info(init_info))

        def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
            self._check_weight_transfer_engine()
            if self._weight_update_active:
                raise RuntimeError(
                    "start_weight_update called while a weight update is already active. Call finish_weight_update "
                    "first."
                )
            self._is_checkpoint_format, self._weight_update_active = is_checkpoint_format, True

        def update_weights(self, update_info: dict) -> None:
            self._check_weight_transfer_engine()
            if not self._weight_update_active:
                raise RuntimeError("start_weight_update must be called before update_weights.")
            typed = self.weight_transfer_engine.parse_update_info(update_info)
            if not self._is_checkpoint_format or typed.update_kind != "dense":
                raise NotImplementedError("this stand-in takes dense checkpoint-format updates only")
            self.weight_transfer_engine.receive_weights(typed, load_weights=self.model_runner.model.load_weights)

        def finish_weight_update(self) -> None:
            self._check_weight_transfer_engine()
            if not self._weight_update_active:
                raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
            self._weight_update_active, self._is_checkpoint_format = False, True

        # -- for the test only -----------------------------------------------------------------------------------
        def test_start(self, weight_transfer_config: dict | None) -> None:
            """What starting vLLM does (``--weight-transfer-config`` or none); forgets earlier syncs."""
            for intake in (getattr(self.weight_transfer_engine, "intake", None), self._vlmreg_intake):
                if intake is not None:
                    intake.close()
            self._vlmreg_intake = None
            self.weight_transfer_engine = (
                WeightTransferEngineFactory.create_engine(
                    SimpleNamespace(**weight_transfer_config), self.parallel_config, resolved.model
                )
                if weight_transfer_config is not None
                else None
            )
            self._weight_update_active = False
            self.model_runner.model.loads = []

        def test_register_plugin(self, path: str, module: str, env: dict[str, str]) -> list[str]:
            """What installing a plugin where vLLM runs does: its transports join this process's registry."""
            os.environ.update(env)

            sys.path.insert(0, path)
            # not found as an entry point
            if not set(get_transport_registry().names()) - {"gloo", "nccl", "ipc", "filesystem"}:
                vlmreg.register_plugin(importlib.import_module(module), name=module)
            return get_transport_registry().names()

        def test_report(self, path: str) -> dict[str, Any]:
            save_file({k: v.detach().clone().contiguous() for k, v in resolved.model.state_dict().items()}, path)
            return {"pid": os.getpid(), "loads": self.model_runner.model.loads}

    worker = Worker()
    conn.send(("ready", os.getpid()))
    while (message := conn.recv()) is not None:
        method, args, kwargs = message
        try:
            conn.send(("ok", getattr(worker, method)(*args, **kwargs)))
        except Exception as exc:  # noqa: BLE001 - reported to the caller, as vLLM's workers do
            conn.send(("error", str(exc)))


class WorkerError(RuntimeError):
    """A worker raised; the message is what vLLM's multiprocessing executor says."""


class Workers:
    """One engine's workers: spawned processes, all called at once (vLLM's ``collective_rpc``)."""

    def __init__(self, size: int) -> None:
        context = mp.get_context("spawn")
        self.conns, self.processes = [], []
        for rank in range(size):
            parent, child = context.Pipe()
            process = context.Process(target=_worker_main, args=(rank, size, child), daemon=True)
            process.start()
            child.close()
            self.conns.append(parent)
            self.processes.append(process)
        self.lock = threading.Lock()
        self.pids = [
            self._reply(conn, process, 120)[1] for conn, process in zip(self.conns, self.processes, strict=True)
        ]

    @staticmethod
    def _reply(conn: Any, process: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not conn.poll(0.1):
            if not process.is_alive():
                raise RuntimeError(f"worker process {process.pid} exited with code {process.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker process {process.pid} did not answer within {timeout} s")
        return conn.recv()

    def call(self, method: str, *args: Any, timeout: float = 90, **kwargs: Any) -> list[Any]:
        with self.lock:
            for conn in self.conns:
                conn.send((method, args, kwargs))
            replies = [
                self._reply(conn, process, timeout) for conn, process in zip(self.conns, self.processes, strict=True)
            ]
        for status, result in replies:
            if status != "ok":
                raise WorkerError(
                    f"Worker failed with error '{result}', please check the stack trace above for the root cause"
                )
        return [result for _, result in replies]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.terminate()
                process.join(5)


# -- vLLM's HTTP front -----------------------------------------------------------------------------------------------


class HTTPError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(status, body)
        self.status, self.body = status, body


def _error_response(message: str, status: int, kind: str) -> HTTPError:
    """vLLM's ErrorResponse (its handlers turn HTTPExceptions and engine exceptions into this)."""
    return HTTPError(status, {"error": {"message": message, "type": kind, "param": None, "code": status}})


def _bad_request(detail: str) -> HTTPError:  # HTTPException(400, detail) through vLLM's http_exception_handler
    return _error_response(detail, 400, HTTPStatus(400).phrase)


WEIGHT_ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update")


class VllmStandIn:
    """vLLM 0.24's routes for the weight updates (``VLLM_SERVER_DEV_MODE=1``) in front of `Workers`.

    ``weight_api=False``: a vLLM without the weight-transfer routes (they answer 404). ``fail``: path -> (status,
    message) answered at once, as an engine error, without reaching the workers. ``slow``: worker method -> seconds a
    ``/collective_rpc`` of it waits after the workers returned before it answers (the way back through vLLM's engine
    and HTTP, drawn out); ``fail_after``: worker method -> message answered then as an engine error. ``calls`` records
    (method, path, body, answer) in arrival order; ``answered`` the time each answer went out, by call index.
    """

    def __init__(
        self,
        workers: Workers,
        *,
        weight_api: bool = True,
        fail: dict[str, tuple[int, str]] | None = None,
        slow: dict[str, float] | None = None,
        fail_after: dict[str, str] | None = None,
    ) -> None:
        self.workers, self.weight_api, self.fail = workers, weight_api, fail or {}
        self.slow, self.fail_after = slow or {}, fail_after or {}
        self.answered: dict[int, float] = {}
        self.calls: list[tuple[str, str, Any, Any]] = []
        self._lock = threading.Lock()
        routes = {
            ("GET", "/health"): lambda body, query: None,
            ("GET", "/get_world_size"): self._world_size,
            ("POST", "/collective_rpc"): self._collective_rpc,
            ("POST", "/reset_prefix_cache"): lambda body, query: None,
            ("POST", "/reset_encoder_cache"): lambda body, query: None,
        }
        if weight_api:
            routes.update(
                {
                    ("POST", "/init_weight_transfer_engine"): self._init,
                    ("POST", "/start_weight_update"): self._start,
                    ("POST", "/update_weights"): self._update,
                    ("POST", "/finish_weight_update"): lambda body, query: (
                        self._engine("finish_weight_update") or {"message": "Weight update finished"}
                    ),
                }
            )
        self.routes = routes
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stand_in._handle(self, "GET")

            def do_POST(self) -> None:
                stand_in._handle(self, "POST")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def posts(self) -> list[str]:
        return [path for method, path, _, _ in self.calls if method == "POST"]

    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        parts = urlsplit(request.path)
        raw = request.rfile.read(int(request.headers.get("Content-Length") or 0))
        path = parts.path
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        entry: list[Any] = [method, path, body, None]
        with self._lock:
            index = len(self.calls)
            self.calls.append(entry)  # type: ignore[arg-type]
        try:
            route = self.routes.get((method, path))
            if route is None:
                status = 405 if any(p == path for _, p in self.routes) else 404
                # Starlette's
                raise HTTPError(status, {"detail": "Method Not Allowed" if status == 405 else "Not Found"})
            if path in self.fail:
                status, message = self.fail[path]
                raise _error_response(message, status, "InternalServerError")
            if (
                method == "POST"
                and path != "/collective_rpc"
                and path in WEIGHT_ROUTES[:3]
                and not isinstance(body, dict)
            ):
                raise _bad_request("Invalid JSON format")
            status, answer = 200, route(body, parts.query)
        except HTTPError as exc:
            status, answer = exc.status, exc.body
        except WorkerError as exc:  # vLLM's exception handler: a RuntimeError is a 500 InternalServerError
            status, answer = 500, _error_response(str(exc), 500, "InternalServerError").body
        entry[3] = (status, answer)
        self.answered[index] = time.monotonic()
        data = b"" if answer is None else json.dumps(answer).encode()  # Response(status_code=200) has no body
        request.send_response(status)
        if answer is not None:
            request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def _engine(self, method: str, *args: Any) -> list[Any]:
        return self.workers.call(method, *args)

    def _world_size(self, body: Any, query: str) -> dict[str, Any]:
        return {"world_size": len(self.workers.conns)}  # TP x PP x DP (include_dp defaults to true)

    def _init(self, body: dict, query: str) -> dict[str, Any]:
        if body.get("init_info") is None:
            raise _bad_request("Missing 'init_info' in request body")
        self._engine("init_weight_transfer_engine", body["init_info"])
        return {"message": "Weight transfer initialized"}

    def _start(self, body: dict, query: str) -> dict[str, Any]:
        self._engine("start_weight_update", body.get("is_checkpoint_format", True))
        return {"message": "Weight update started"}

    def _update(self, body: dict, query: str) -> dict[str, Any]:
        if body.get("update_info") is None:
            raise _bad_request("Missing 'update_info' in request body")
        self._engine("update_weights", body["update_info"])
        return {"message": "Weights updated"}

    def _collective_rpc(self, body: Any, query: str) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise _bad_request("JSON decode error")
        if body.get("method") is None:
            raise _bad_request("Missing 'method' in request body")
        results = self.workers.call(body["method"], *body.get("args", []), **body.get("kwargs", {}))
        time.sleep(self.slow.get(body["method"], 0.0))
        if body["method"] in self.fail_after:
            raise _error_response(self.fail_after[body["method"]], 500, "InternalServerError")
        return {"results": [r if r is None or isinstance(r, dict | list) else str(r) for r in results]}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- fixtures --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers():
    pool = Workers(WORKERS)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def trainer():
    return vlmreg.load(parse_config(_config()))


def attach_config(url: str, *, timeout_s: float = 30.0):
    return resolve_config(
        parse_config(
            {
                **_config(),
                "rollout": {"engine": "openai", "server": "vllm", "url": url},
                "broadcast": {"transport": "gloo", "timeout_s": timeout_s},
            }
        )
    )


def trainer_state(loaded) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in loaded.resolved.model.state_dict().items()}


def worker_states(workers: Workers, directory: Path) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"worker{i}.safetensors" for i in range(len(workers.conns))]
    # each worker writes its own file: call them one by one through their pipes with their own path
    reports = []
    with workers.lock:
        for conn, process, path in zip(workers.conns, workers.processes, paths, strict=True):
            conn.send(("test_report", (str(path),), {}))
            status, report = Workers._reply(conn, process, 60)
            assert status == "ok", report
            reports.append((report, load_file(str(path))))
    return reports


def change_weights(loaded, scale: float) -> None:
    """A large change to trainable weights: lm_head += 1, a decoder weight and a connector weight scaled."""
    resolved = loaded.resolved
    decoder = next(
        p for n, p in resolved.model.named_parameters() if ".layers.0." in n and p.requires_grad and p.dim() == 2
    )
    connector = next(
        p for m in resolved.connectors.values() for p in m.parameters() if p.requires_grad and p.dim() == 2
    )
    with torch.no_grad():
        resolved.lm_head.weight.add_(1.0)
        decoder.mul_(scale)
        connector.mul_(scale)


def plan_names(loaded, *, full: bool) -> list[str]:
    return [name for name, _ in WeightPlan.from_resolved(loaded.resolved, include_frozen_vision=full).shapes()]


SYNC = [
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/reset_prefix_cache",
    "/reset_encoder_cache",
]


# -- 1 and 2: tensor parallel 2 through vLLM's weight-transfer API ---------------------------------------------------


def test_tensor_parallel_workers_take_every_sync_through_the_weight_transfer_api(workers, trainer, tmp_path):
    workers.call("test_start", {"backend": "vlmreg"})  # --weight-transfer-config '{"backend": "vlmreg"}'
    stand_in = VllmStandIn(workers)
    messages: list[str] = []
    server = VllmServer(
        attach_config(stand_in.url), trainer.resolved, trainer.processor, torch.device("cpu"), tmp_path, messages.append
    )
    try:
        assert server.api
        assert [(m, p) for m, p, _, _ in stand_in.calls] == [
            ("GET", "/get_world_size"),
            ("POST", "/init_weight_transfer_engine"),
        ]
        group = server.sender.sender  # the gloo transport's `Sender`
        assert stand_in.calls[0][3] == (200, {"world_size": 2}) and group.num_receivers == 2
        assert group.alive == server.check_alive  # a launched vLLM that dies while a sync waits for it: named at once
        init = stand_in.calls[1][2]["init_info"]
        assert init == {
            "transport": "gloo",
            "timeout_s": 30.0,
            "info": {"host": "127.0.0.1", "port": group.port, "token": group.token},
        }
        # both workers joined, as ranks 1 and 2, rank 1 being worker 0 (the sender saw their hellos)
        assert {rank: info["pid"] for rank, info in group._receivers.items()} == {
            1: workers.pids[0],
            2: workers.pids[1],
        }

        full, step = plan_names(trainer, full=True), plan_names(trainer, full=False)
        assert len(step) < len(full)  # the frozen vision tower is only in the full plan
        for n, (sync_full, scale) in enumerate([(True, 3.0), (False, -2.0), (False, 0.5)]):
            before = len(stand_in.calls)
            server.sync(n, full=sync_full)
            calls = stand_in.calls[before:]
            assert [p for _, p, _, _ in calls] == SYNC, f"sync {n}"
            assert all(m == "POST" and answer[0] == 200 for m, _, _, answer in calls)
            assert calls[0][2] == {"is_checkpoint_format": True}
            assert calls[1][2] == {"update_info": {"step": n, "timeout_s": 30.0, "fields": {}}}
            reference = trainer_state(trainer)
            for worker, (report, state) in enumerate(worker_states(workers, tmp_path / f"sync{n}")):
                assert report["pid"] == workers.pids[worker]
                assert sorted(report["loads"][-1]) == sorted(full if sync_full else step), f"worker {worker}, sync {n}"
                assert_state_equal(state, reference)
            change_weights(trainer, scale)  # the next sync must carry this
            changed = trainer_state(trainer)
            assert sum(not torch.equal(changed[k], reference[k]) for k in reference) == 3
        assert [s.kind for s in server.history] == ["full", "step", "step"]
    finally:
        server.close()
        stand_in.close()


def test_two_servers_join_one_weight_group_and_every_worker_takes_each_sync(workers, trainer, tmp_path):
    """`[rollout] url` with two vLLMs (tensor parallel 2 and 1): one sender, one group of ranks 1..3 (server 2's worker
    after server 1's two), one broadcast per sync; each request goes to both servers, and every worker of both holds
    the trainer's weights after each sync."""
    workers.call("test_start", {"backend": "vlmreg"})
    second = Workers(1)
    try:
        second.call("test_start", {"backend": "vlmreg"})
        stand_ins = [VllmStandIn(workers), VllmStandIn(second)]
        rc = resolve_config(
            parse_config(
                {
                    **_config(),
                    "rollout": {"engine": "openai", "server": "vllm", "url": [s.url for s in stand_ins]},
                    "broadcast": {"transport": "gloo", "timeout_s": 30.0},
                }
            )
        )
        server = VllmServer(rc, trainer.resolved, trainer.processor, torch.device("cpu"), tmp_path, lambda m: None)
        try:
            group = server.sender.sender
            assert group.num_receivers == 3
            firsts = [s.calls[1][2]["init_info"]["info"]["first_rank"] for s in stand_ins]
            assert firsts == [1, 3]
            assert {rank: info["pid"] for rank, info in group._receivers.items()} == {
                1: workers.pids[0],
                2: workers.pids[1],
                3: second.pids[0],
            }
            for n, scale in enumerate([3.0, -2.0]):
                server.sync(n, full=n == 0)
                assert all([p for _, p, _, _ in s.calls[-len(SYNC) :]] == SYNC for s in stand_ins), n
                reference = trainer_state(trainer)
                for pool, directory in ((workers, "first"), (second, "second")):
                    for _report, state in worker_states(pool, tmp_path / f"{directory}{n}"):
                        assert_state_equal(state, reference)
                change_weights(trainer, scale)
            assert [s.kind for s in server.history] == ["full", "step"]  # one broadcast per sync, not one per server
        finally:
            server.close()
            for stand_in in stand_ins:
                stand_in.close()
    finally:
        second.close()


# -- 3: a vLLM whose weight-transfer API is absent or not configured: /collective_rpc ---------------------------------


@pytest.mark.parametrize("kind", ["absent", "not configured"])
def test_without_the_weight_transfer_api_the_worker_extension_takes_the_syncs(workers, trainer, tmp_path, kind):
    # "absent": a vLLM without the routes (404); "not configured": vLLM 0.24 started without --weight-transfer-config
    workers.call("test_start", None)
    stand_in = VllmStandIn(workers, weight_api=kind == "not configured")
    started = time.monotonic()
    server = VllmServer(
        attach_config(stand_in.url), trainer.resolved, trainer.processor, torch.device("cpu"), tmp_path, lambda m: None
    )
    try:
        joined = time.monotonic() - started
        assert not server.api
        init = stand_in.calls[1]
        assert init[1] == "/init_weight_transfer_engine"
        if kind == "absent":
            assert init[3] == (404, {"detail": "Not Found"})
        else:
            assert init[3][0] == 500 and "Weight transfer not configured" in init[3][1]["error"]["message"]
        assert joined < 15, f"the fallback waited {joined:.0f} s for workers that were never asked to join"
        rpc, group = stand_in.calls[2], server.sender.sender
        assert rpc[1] == "/collective_rpc" and rpc[2]["method"] == "vlmreg_join_weight_group"
        assert [json.loads(a) for a in rpc[2]["args"]] == [
            {
                "transport": "gloo",
                "timeout_s": 30.0,
                "info": {"host": "127.0.0.1", "port": group.port, "token": group.token},
            }
        ]
        assert rpc[3] == (200, {"results": ["0", "1"]})  # the workers' global ranks

        full, step = plan_names(trainer, full=True), plan_names(trainer, full=False)
        for n, sync_full in enumerate([True, False]):
            before = len(stand_in.calls)
            server.sync(n, full=sync_full)
            server.rpc_syncs.settle()  # the workers confirmed through the weight group: vLLM's answer is taken here
            calls = stand_in.calls[before:]
            assert [p for _, p, _, _ in calls] == ["/collective_rpc", "/reset_prefix_cache", "/reset_encoder_cache"]
            assert calls[0][2]["method"] == "vlmreg_receive_weights"
            assert [json.loads(a) for a in calls[0][2]["args"]] == [{"step": n, "timeout_s": 30.0, "fields": {}}]
            count = len(full if sync_full else step)
            assert calls[0][3] == (200, {"results": [str(count), str(count)]})
            reference = trainer_state(trainer)
            for report, state in worker_states(workers, tmp_path / f"sync{n}"):
                assert sorted(report["loads"][-1]) == sorted(full if sync_full else step)
                assert_state_equal(state, reference)
            change_weights(trainer, 1.5)
        assert not any(p in ("/start_weight_update", "/finish_weight_update") for p in stand_in.posts())
    finally:
        server.close()
        stand_in.close()


def test_with_the_engine_scoping_its_requests_a_sync_clears_no_cache(workers, trainer, tmp_path):
    """The OpenAI engine puts the server's `CacheScope` on its requests: each sync moves to a new scope instead of
    clearing vLLM's prefix and encoder caches (two requests fewer per sync)."""

    workers.call("test_start", None)
    stand_in = VllmStandIn(workers, weight_api=False)
    server = VllmServer(
        attach_config(stand_in.url), trainer.resolved, trainer.processor, torch.device("cpu"), tmp_path, lambda m: None
    )
    try:
        assert not server.push  # attached over gloo: syncs always go through vLLM
        assert server.cache_scope.images  # the tiny config trains the connectors: image embeddings change per sync
        OpenAIEngine(server.url, trainer.processor, ImageStore(), model="m", cache_scope=server.cache_scope)
        salts = []
        for n in range(2):
            before = len(stand_in.calls)
            salts.append(server.cache_scope.salt)
            started = time.perf_counter()
            server.sync(n, full=n == 0)
            took = time.perf_counter() - started
            assert [p for _, p, _, _ in stand_in.calls[before:]] == ["/collective_rpc"]
            assert server.cache_scope.version == n + 1
            # the sync's parts, for the metrics: the request (the workers' receive and load) within the transfer
            assert sorted(server.parts) == ["sync_request_s", "sync_transfer_s"]
            assert 0 < server.parts["sync_request_s"] <= server.parts["sync_transfer_s"] <= took
            for _report, state in worker_states(workers, tmp_path / f"sync{n}"):
                assert_state_equal(state, trainer_state(trainer))
            change_weights(trainer, 1.5)
        assert len(set(salts + [server.cache_scope.salt])) == 3
    finally:
        server.close()
        stand_in.close()


# -- 3a: syncs through /collective_rpc confirmed by the workers, and asked for early
# ------------------------------------


def direct_config(url: str, **broadcast: Any):
    return resolve_config(
        parse_config(
            {
                **_config(),
                "rollout": {"engine": "openai", "server": "vllm", "url": url},
                "broadcast": {"transport": "gloo", "timeout_s": 30.0, "vllm_load": "direct", **broadcast},
            }
        )
    )


WORKER_TIMINGS = {"sync_worker_wait_s", "sync_worker_receive_s", "sync_worker_copy_s", "sync_worker_tail_s"}


def test_a_sync_returns_once_sent_and_its_answer_is_settled_before_the_next_use(workers, trainer, tmp_path):
    """The trainer returns once its broadcast is done, waiting neither for the workers' confirmation through the
    store (never true here) nor for vLLM's answer (held back 1.5 s, a slow way back through its engine and HTTP
    server); a request after it waits for the RPC, as in vLLM's engine loop, so the workers' weights read then are the
    trainer's. `settle` takes the answer (the workers' timings of that sync come with the next sync's metrics) and
    raises an error it carries, as does the next sync."""
    workers.call("test_start", None)
    stand_in = VllmStandIn(workers, weight_api=False, slow={"vlmreg_receive_weights": 1.5})
    server = VllmServer(
        direct_config(stand_in.url, vllm_early_receive="never"),
        trainer.resolved,
        trainer.processor,
        torch.device("cpu"),
        tmp_path,
        lambda m: None,
    )
    server.sender.confirmed = lambda: False  # a wait for the confirmation would last until vLLM's answer
    try:
        OpenAIEngine(server.url, trainer.processor, ImageStore(), model="m", cache_scope=server.cache_scope)
        for n in range(3):
            before = len(stand_in.calls)
            server.sync(n, full=n == 0)
            rpc = next(i for i, c in enumerate(stand_in.calls) if i >= before and c[1] == "/collective_rpc")
            assert rpc not in stand_in.answered, f"sync {n} waited for vLLM's answer"
            for _report, state in worker_states(workers, tmp_path / f"sync{n}"):
                assert_state_equal(state, trainer_state(trainer))
            metrics = server.sync_metrics()
            assert {"sync_ready_s", "sync_send_s", "sync_ack_s"} <= set(metrics)
            assert metrics["sync_early"] == 0.0 and metrics["sync_ack_s"] < 1.5
            previous = {name.replace("sync_worker_", "sync_prev_worker_") for name in WORKER_TIMINGS}
            assert (previous | {"sync_prev_settle_s"} <= set(metrics)) == (n > 0), sorted(metrics)
            change_weights(trainer, 1.5)
        server.settle()
        assert stand_in.calls[rpc][3] == (200, {"results": [str(len(plan_names(trainer, full=False)))] * WORKERS})
        stand_in.fail_after["vlmreg_receive_weights"] = "the engine died after loading"
        server.sync(3)  # sent; vLLM's failing answer comes later
        with pytest.raises(VlmregError, match="failed after taking the weights.*the engine died after loading"):
            server.settle()
        server.sync(4)
        with pytest.raises(VlmregError, match="failed after taking the weights.*the engine died after loading"):
            server.sync(5)
    finally:
        server.close()
        stand_in.close()


def test_workers_asked_early_wait_through_the_update_and_the_sync_makes_no_request(workers, trainer, tmp_path):
    """``vllm_early_receive``: the request reaches the workers while the trainer updates; the sync itself then makes
    no request at all, and the workers hold the trainer's weights after it. Workers that fail on the request asked
    early are reported by the next sync at once (no broadcast into no one); a trainer that closes while the workers
    wait ends their wait."""
    workers.call("test_start", None)
    stand_in = VllmStandIn(workers, weight_api=False)
    server = VllmServer(
        direct_config(stand_in.url, vllm_early_receive="always"),
        trainer.resolved,
        trainer.processor,
        torch.device("cpu"),
        tmp_path,
        lambda m: None,
    )
    try:
        OpenAIEngine(server.url, trainer.processor, ImageStore(), model="m", cache_scope=server.cache_scope)
        server.sync(0, full=True)
        for n in (1, 2, 3):
            assert server.post_early(n)
            time.sleep(0.3)  # the update
            change_weights(trainer, 1.5)
            asked = len(stand_in.calls)
            server.sync(n)
            assert stand_in.calls[asked:] == []
            path, body = stand_in.calls[asked - 1][1:3]
            assert path == "/collective_rpc" and body["method"] == "vlmreg_receive_weights"
            assert json.loads(body["args"][0]) == {"step": n, "timeout_s": None, "fields": {}}
            for _report, state in worker_states(workers, tmp_path / f"sync{n}"):
                assert_state_equal(state, trainer_state(trainer))
            metrics = server.sync_metrics()
            assert metrics["sync_early"] == 1.0
            if n > 1:  # the sync before, asked early: its workers waited through the update (settled by post_early)
                assert metrics["sync_prev_worker_wait_s"] >= 0.25
        server.rpc_syncs.settle()

        workers.call("test_start", None)  # workers that forgot the weight group: the request asked early fails
        assert server.post_early(4)
        posted = server.rpc_syncs.posted
        assert posted is not None and posted[1].wait(30)
        started = time.monotonic()
        with pytest.raises(VlmregError, match="vlmreg_join_weight_group has not been called"):
            server.sync(4)
        assert time.monotonic() - started < 5  # not the 30 s of broadcast.timeout_s
    finally:
        server.close()
        stand_in.close()


def test_closing_the_trainer_ends_the_wait_of_workers_asked_early(workers, trainer, tmp_path):
    workers.call("test_start", None)
    stand_in = VllmStandIn(workers, weight_api=False)
    server = VllmServer(
        direct_config(stand_in.url, vllm_early_receive="always"),
        trainer.resolved,
        trainer.processor,
        torch.device("cpu"),
        tmp_path,
        lambda m: None,
    )
    try:
        server.sync(0, full=True)
        assert server.post_early(1)
        deadline = time.monotonic() + 30
        while len(stand_in.calls) < 4 and time.monotonic() < deadline:  # get_world_size, join, sync, the early ask
            time.sleep(0.01)
        time.sleep(0.3)  # the workers are in their receive
    finally:
        server.close()
        stand_in.close()
    assert workers.lock.acquire(timeout=30), "the workers are still waiting for a sync that will never come"
    workers.lock.release()
    workers.call("test_start", None)


# -- 3b: a third party's transport (the example plugin's one_file) in vLLM's workers ----------------------------------

EXTRAS = Path(__file__).resolve().parents[2] / "examples" / "plugins" / "vlmreg-example-extras" / "src"


@pytest.mark.parametrize("load", ["api", "direct"])
def test_a_plugin_transport_with_a_vllm_end_carries_every_sync_to_every_worker(
    workers, trainer, tmp_path, load, monkeypatch, vlmreg_add_plugin
):
    """``one_file`` is registered by a plugin, not by vlmreg: the trainer builds its sender from the registry, each
    worker its ``vllm_receiver`` from its own registry; tensor parallel 2, through vLLM's weight-transfer API and
    through
    ``/collective_rpc`` (``vllm_load = "direct"``)."""
    monkeypatch.syspath_prepend(str(EXTRAS))
    monkeypatch.setenv("VLMREG_EXTRAS_TRACE", str(tmp_path / "trace.txt"))

    # a checkout with a built egg-info finds it as an entry point
    if "one_file" not in get_transport_registry().names():
        vlmreg_add_plugin(importlib.import_module("vlmreg_example_extras"), "vlmreg_example_extras")
    env = {"VLMREG_EXTRAS_TRACE": str(tmp_path / "trace.txt")}
    assert all(
        "one_file" in names for names in workers.call("test_register_plugin", str(EXTRAS), "vlmreg_example_extras", env)
    )
    workers.call("test_start", {"backend": "vlmreg"} if load == "api" else None)
    stand_in = VllmStandIn(workers, weight_api=load == "api")
    config = resolve_config(
        parse_config(
            {
                **_config(),
                "rollout": {"engine": "openai", "server": "vllm", "url": stand_in.url},
                "broadcast": {
                    "transport": "one_file",
                    "timeout_s": 30.0,
                    "vllm_load": "reload" if load == "api" else "direct",
                },
            }
        )
    )
    server = VllmServer(config, trainer.resolved, trainer.processor, torch.device("cpu"), tmp_path, lambda m: None)
    try:
        directory = str(tmp_path / "one_file")
        joined = {"transport": "one_file", "timeout_s": 30.0, "info": {"directory": directory}}
        if load == "api":
            assert stand_in.calls[1][1:3] == ["/init_weight_transfer_engine", {"init_info": joined}]
        else:
            assert stand_in.calls[1][2] == {"method": "vlmreg_join_weight_group", "args": [json.dumps(joined)]}
        full, step = plan_names(trainer, full=True), plan_names(trainer, full=False)
        for n, sync_full in enumerate([True, False]):
            before = len(stand_in.calls)
            server.sync(n, full=sync_full)
            update = next(c for c in stand_in.calls[before:] if c[1] in ("/update_weights", "/collective_rpc"))
            sent = update[2]["update_info"] if load == "api" else json.loads(update[2]["args"][0])
            assert sent == {"step": n, "timeout_s": 30.0, "fields": {"file": f"{directory}/step_{n:06d}.safetensors"}}
            reference = trainer_state(trainer)
            for report, state in worker_states(workers, tmp_path / f"sync{n}"):
                assert sorted(report["loads"][-1]) == sorted(full if sync_full else step)
                assert_state_equal(state, reference)
            change_weights(trainer, 1.5)
        trace = (tmp_path / "trace.txt").read_text().split()
        # every worker read every sync's file
        assert trace.count("sender") == 2 and trace.count("worker") == 2 * WORKERS
        # a worker reads only files in the directory it was told: an update naming another file is refused
        with pytest.raises(VlmregError, match="is not a step_NNNNNN.safetensors file in"):
            server.sender.send = lambda step, *, full, request: request({"file": "/etc/passwd"})
            server.sync(2)
    finally:
        server.close()
        stand_in.close()


# -- 4: errors, and the launch command -------------------------------------------------------------------------------


def test_an_update_the_server_refuses_is_an_error_with_its_url_and_message(workers, trainer, tmp_path):
    workers.call("test_start", {"backend": "vlmreg"})
    message = "Worker failed with error 'CUDA error: an illegal memory access was encountered'"
    stand_in = VllmStandIn(workers, fail={"/update_weights": (500, message)})
    timeout_s = 4.0
    server = VllmServer(
        attach_config(stand_in.url, timeout_s=timeout_s),
        trainer.resolved,
        trainer.processor,
        torch.device("cpu"),
        tmp_path,
        lambda m: None,
    )
    try:
        started = time.monotonic()
        with pytest.raises(VlmregError) as caught:
            server.sync(0, full=True)
        assert time.monotonic() - started < timeout_s + 20
        text = str(caught.value)
        assert f"{stand_in.url}/update_weights" in text and "500" in text and message in text
        assert stand_in.posts()[-2:] == ["/start_weight_update", "/update_weights"]  # nothing after the failure
    finally:
        server.close()
        stand_in.close()


def launch_config(**rollout: Any):
    return resolve_config(
        parse_config(
            {
                **_config(),
                "rollout": {"engine": "openai", "server": "vllm", "launch": True, **rollout},
                "broadcast": {"transport": "gloo"},
            }
        )
    )


@pytest.mark.parametrize(("where", "fraction"), [("same", "0.3"), ("next", "0.9")])
def test_the_launch_command_has_what_rl_needs(where, fraction):
    command = vllm_command(
        launch_config(launch_gpu=where, server_args=["--max-num-seqs", "8", "--enforce-eager"]),
        "/ckpt",
        8123,
        "bfloat16",
        4096,
    )
    assert command[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]

    def value(flag: str) -> str:
        assert command.count(flag) == 1, flag
        return command[command.index(flag) + 1]

    assert value("--worker-extension-cls") == "vlmreg.inference.vllm_worker.VlmregWorkerExtension"
    assert json.loads(value("--weight-transfer-config")) == {"backend": "vlmreg"}
    assert value("--logprobs-mode") == "processed_logprobs"
    assert value("--generation-config") == "vllm"
    assert value("--gpu-memory-utilization") == fraction
    assert (value("--model"), value("--port"), value("--dtype"), value("--max-model-len")) == (
        "/ckpt",
        "8123",
        "bfloat16",
        "4096",
    )
    assert command[-3:] == ["--max-num-seqs", "8", "--enforce-eager"]
    explicit = vllm_command(launch_config(launch_gpu="next", gpu_memory_fraction=0.55), "/ckpt", 1, "float32", 64)
    assert explicit[explicit.index("--gpu-memory-utilization") + 1] == "0.55"


def test_with_a_thinking_budget_vllm_is_launched_with_the_familys_markers_as_its_reasoning_config():
    """vLLM refuses ``thinking_token_budget`` without ``--reasoning-config``; its strings must be the family's markers,
    each one token of the model's tokenizer, encoded as vLLM encodes them (``ReasoningConfig.initialize_token_ids``:
    ``tokenizer.encode(s, add_special_tokens=False)``), and the very token the chat template opens the thinking with."""

    def command(**rollout: Any) -> list[str]:
        rc = resolve_config(
            parse_config(
                {
                    "model": {"init": "random", "family": "qwen3_5"},
                    "trainer": {"device": "cpu"},
                    "rollout": {"engine": "openai", "server": "vllm", "launch": True, "thinking_mode": "on", **rollout},
                    "broadcast": {"transport": "gloo"},
                }
            )
        )
        return vllm_command(rc, "/ckpt", 8123, "bfloat16", 4096)

    assert "--reasoning-config" not in command()
    with_budget = command(thinking_budget=64, server_args=["--enforce-eager"])
    # server_args still last
    assert with_budget.count("--reasoning-config") == 1 and with_budget[-1] == "--enforce-eager"
    config = json.loads(with_budget[with_budget.index("--reasoning-config") + 1])
    assert set(config) == {"reasoning_start_str", "reasoning_end_str"}
    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": "qwen3_5"}, "trainer": {"device": "cpu"}}))
    tokenizer = loaded.processor.tokenizer
    [start], [end] = (
        tokenizer.encode(config[k], add_special_tokens=False) for k in ("reasoning_start_str", "reasoning_end_str")
    )
    assert (
        tokenizer.decode([start]) == config["reasoning_start_str"]
        and tokenizer.decode([end]) == config["reasoning_end_str"]
    )
    encoder = PromptEncoder(loaded.processor, ImageStore(), loaded.resolved.descriptor)
    on = encoder.encode([{"role": "user", "content": "hi"}], template_kwargs={"enable_thinking": True}).input_ids
    off = encoder.encode([{"role": "user", "content": "hi"}], template_kwargs={"enable_thinking": False}).input_ids
    # on opens the block; off opens and closes it
    assert start in on and end not in on and off.index(end) > off.index(start)


def test_launching_needs_vllm_and_a_gpu(trainer, tmp_path, monkeypatch):
    rc = launch_config()
    assert importlib.util.find_spec("vllm") is None
    with pytest.raises(VlmregError, match=r'launch = true: vLLM is not importable by .*pip install "vlmreg\[vllm\]"'):
        VllmServer(rc, trainer.resolved, trainer.processor, torch.device("cpu"), tmp_path, lambda m: None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    with pytest.raises(VlmregError, match=r"launch = true needs the trainer on a GPU; it runs on cpu"):
        VllmServer(rc, trainer.resolved, trainer.processor, torch.device("cpu"), tmp_path, lambda m: None)
    assert list(tmp_path.iterdir()) == []  # nothing was exported or started


def test_a_launched_vllm_that_never_becomes_ready_is_stopped_with_the_error(trainer, tmp_path, monkeypatch):
    """A server that stays up but never answers /health: the error, and no process left holding the GPU."""

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(
        vllm_server, "vllm_command", lambda *a, **k: [sys.executable, "-c", "import time; time.sleep(120)"]
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def record(*args: Any, **kwargs: Any) -> subprocess.Popen:
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", record)
    try:
        with pytest.raises(VlmregError, match=r"not ready within rollout.launch_timeout_s = 1 s"):
            VllmServer(
                launch_config(launch_gpu="same", launch_timeout_s=1.0),
                trainer.resolved,
                ProcessorStandIn(),
                torch.device("cuda", 0),
                tmp_path,
                lambda m: None,
            )
        assert len(started) == 1 and started[0].poll() is not None, "the launched process outlived the error"
    finally:
        for process in started:  # a failing run must not leave the stand-in sleeping
            if process.poll() is None:
                process.kill()
                process.wait()


# -- 5: the checkpoint a launched vLLM loads -------------------------------------------------------------------------


class ProcessorStandIn:
    """The training processor, as far as export_checkpoint uses it (the real Qwen one needs torchvision to export)."""

    def __init__(self) -> None:
        self.saved: list[Path] = []

    def save_pretrained(self, directory: Any) -> None:
        self.saved.append(Path(directory))
        (Path(directory) / "processor_stand_in.json").write_text("{}")


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_the_exported_checkpoint_loads_back_in_transformers_to_the_trainers_weights(tmp_path, family):
    loaded = vlmreg.load(parse_config(_config(family)))
    processor = ProcessorStandIn()
    directory = export_checkpoint(loaded.resolved, processor, tmp_path / "vllm-model")
    assert directory == tmp_path / "vllm-model"
    assert processor.saved == [directory] and (directory / "processor_stand_in.json").exists()
    assert {p.name for p in directory.iterdir()} >= {"config.json", "model.safetensors"}
    model, info = AutoModelForImageTextToText.from_pretrained(directory, output_loading_info=True, dtype=loaded.dtype)
    assert type(model) is type(loaded.resolved.model)
    assert {k: v for k, v in info.items() if v} == {}  # no missing, unexpected or mismatched weights
    assert_state_equal(model.state_dict(), loaded.resolved.model.state_dict())


# -- pushed syncs: the trainer replays the worker's exported plan (CUDA IPC on a GPU; here in one process) ------------


def test_syncs_are_pushed_once_the_worker_exports_its_plan_and_go_through_vllm_when_the_weights_move(monkeypatch):
    """`VllmServer`'s side of pushed syncs against a real `WeightIntake` with an engine-style fused model: the plan is
    asked for after each sync until the worker has one (vLLM's /collective_rpc answers ``{"results": [...]}``), then
    syncs make no request and leave the engine's weights what its loader would make; when the trainer's tensors move,
    the sync goes through the worker again and the plan is asked for anew. CUDA IPC is replaced by one process's
    own tensors (`tests.broadcast.test_copy_plan._Shared`); the GPU test is `tests/broadcast/test_ipc.py`."""

    shared = _Shared()
    monkeypatch.setattr(ipc, "describe", shared.share)
    monkeypatch.setattr(ipc, "open_tensor", lambda entry, index, what="": (shared.open(entry), None))
    monkeypatch.setattr(ipc, "gpu_uuid", lambda device=None: "GPU-same")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: types.SimpleNamespace(synchronize=lambda: None))
    engine = FusedModel(1, 2)
    intake = WeightIntake(0, types.SimpleNamespace(type="cuda"), engine)  # a worker on "the" GPU
    pairs = checkpoint(0)  # the trainer's weights
    layout = {"id": "layout-1"}

    class Receiver:  # the worker's IPC receiver: the trainer's tensors, in place
        def receive(self, *, step, timeout_s=None, **fields):
            return list(pairs)

        def close(self):
            pass

    intake._receiver, intake.transport = Receiver(), "ipc"
    calls = []

    def rpc(url, method, args):
        calls.append(method)
        if method == "vlmreg_receive_weights":
            update = json.loads(args[0])
            return {"results": [intake.receive(update, engine.load_weights)]}
        return {"results": [json.dumps(intake.export_plan(args[0]))]}

    class Sender:  # the IPC sender: its held tensors, and whether they are still where the last message said
        ipc = types.SimpleNamespace(hold=[t for _, t in pairs], unchanged=lambda: layout["id"])

        def send(self, step, *, full, request):
            request({"ipc": {"id": layout["id"]}})

    server = object.__new__(VllmServer)
    messages: list[str] = []
    server.__dict__.update(
        push=True,
        pushed=None,
        push_refused=None,
        push_asks=0,
        pushes=0,
        api=False,
        history=[],
        urls=["http://vllm"],
        count=1,
        device=torch.device("cpu"),
        cache_scope=CacheScope(applied=True),
        sender=Sender(),
        log=messages.append,
        check_alive=lambda: None,
        _rpc=rpc,
        timeout_s=30.0,
        api_key=None,
        last_stats=None,
    )
    server.rpc_syncs = RpcSyncs(server, early=False)
    for step in range(6):
        refill(pairs, step)
        calls.clear()
        server.sync(step)
        expected = reference(pairs, rank=1, world=2)
        assert all(torch.equal(v, expected[k]) for k, v in engine.state_dict().items()), step
        # syncs 0 and 1 go through the worker (loaded, then recorded), each then asking for the plan; later ones are
        # pushed
        assert calls == ([] if step >= 2 else ["vlmreg_receive_weights", "vlmreg_export_copy_plan"]), step
    assert server.pushes == 4 and server.cache_scope.version == 6
    assert any("later syncs are pushed" in m for m in messages)
    # the trainer's tensors moved (a new allocation): the pushed copies would read the old memory
    pairs[:] = [(n, t.clone()) for n, t in pairs]
    layout["id"] = "layout-2"
    Sender.ipc.hold = [t for _, t in pairs]
    refill(pairs, 9)
    calls.clear()
    server.sync(9)
    assert calls == ["vlmreg_receive_weights", "vlmreg_export_copy_plan"] and server.pushed is None
    assert all(torch.equal(v, reference(pairs, rank=1, world=2)[k]) for k, v in engine.state_dict().items())
    assert any("the weights moved" in m for m in messages)
