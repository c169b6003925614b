"""The plumbing under `vlmreg.broadcast.transport`: the sender's store and its secret-token prefix, joining it within a
wall-clock deadline, building a private NCCL/gloo process group on it (never the default group), one-root
broadcasts, and a bounded shutdown."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vlmreg.broadcast.errors import BroadcastError

__all__ = [
    "BACKENDS",
    "FOREVER",
    "KEY",
    "TOKEN_ENV",
    "broadcast",
    "device_for",
    "identity",
    "join_group",
    "join_store",
    "process_group",
    "scoped",
    "shutdown_group",
    "store_failed",
    "teardown_pending",
]

BACKENDS = ("nccl", "gloo")
KEY = "vlmreg/broadcast/"
TOKEN_ENV = "VLMREG_WEIGHTS_TOKEN"


def scoped(store: Any, token: str) -> Any:
    """The part of the store under the token: without the token, no key of the protocol can be named."""
    return dist.PrefixStore(f"{KEY}{token}/", store)


FOREVER = timedelta(days=365)


def identity() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def device_for(backend: str, device: torch.device | str | None) -> torch.device:
    if backend not in BACKENDS:
        raise BroadcastError(f"unknown backend {backend!r}: use 'nccl' (GPU) or 'gloo' (CPU)")
    if backend == "gloo":
        return torch.device("cpu")
    if not dist.is_nccl_available() or not torch.cuda.is_available():
        raise BroadcastError("backend 'nccl' needs CUDA and a torch build with NCCL; use 'gloo' on CPU")
    chosen = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if chosen.type != "cuda":
        raise BroadcastError(f"backend 'nccl' needs a CUDA device, got {chosen}")
    return chosen


def process_group(backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    """A process group of its own (not registered as the default), on a prefix of the broadcaster's store."""
    pg_store = dist.PrefixStore(KEY + "pg", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(pg_store, rank, size, timeout)
    return dist.ProcessGroupNCCL(pg_store, rank, size, timeout)  # type: ignore[arg-type]  # torch's stub lacks the timeout overload


def broadcast(group: Any, tensor: torch.Tensor) -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def join_group(
    backend: str, store: dist.Store, rank: int, size: int, timeout: timedelta, device: torch.device, failed: Any
) -> Any:
    """Build the process group and pass one broadcast through it (every rank must take part), within ``timeout``;
    a store error (a peer that never came, or left) becomes ``failed(reason)``, a `BroadcastError`."""
    try:
        group = process_group(backend, store, rank, size, timeout)
        broadcast(group, torch.zeros(1, dtype=torch.uint8, device=device)).wait()
    except store_failed() as exc:
        raise failed(" ".join(str(exc).split("\n", 1)[0].split())[:200]) from None
    return group


#: Releases that did not finish in time (their threads still blocked in NCCL); see `teardown_pending`.
_STUCK: list[threading.Thread] = []


def shutdown_group(group: Any, backend: str, timeout_s: float = 15.0) -> None:
    """Release an NCCL communicator explicitly (torch warns at exit otherwise); gloo needs nothing.

    The communicator is aborted (``ncclCommAbort``, local), not shut down: measured on two H200s with vLLM's worker as
    the peer, ``shutdown`` (finalize, then destroy) blocked while the worker's end stayed open, and an abort after it
    waited 120 s behind it. The release runs in a daemon thread, waited for at most ``timeout_s``; one still blocked
    after that is left behind and reported by `teardown_pending`, so the process can exit without it.
    """
    release = getattr(group, "abort", None) if backend == "nccl" else None
    if not callable(release):
        release = getattr(group, "shutdown", None) if backend == "nccl" else None
    if not callable(release):
        return
    done = threading.Event()

    def run() -> None:
        try:
            release()
        except RuntimeError:
            pass
        finally:
            done.set()

    thread = threading.Thread(target=run, name="vlmreg-nccl-release", daemon=True)
    thread.start()
    if not done.wait(timeout_s):
        _STUCK.append(thread)


def teardown_pending() -> bool:
    """Whether a communicator release is still blocked; a CLI then exits without waiting for native teardown."""
    return any(thread.is_alive() for thread in _STUCK)


def store_failed() -> tuple[type[BaseException], ...]:
    return (RuntimeError, getattr(dist, "DistError", RuntimeError))


def join_store(host: str, port: int, rank: int, timeout_s: float, token: str) -> tuple[Any, dict[str, Any]]:
    """Connect to the sender's store and read its ``sender`` record, all within ``timeout_s`` of wall-clock time.

    ``TCPStore``'s own timeout does not bound this: against a closed port it retries with back-off past it, and
    against a port where something else listens (accepting and never answering, or not even accepting) its
    handshake waits forever. So the port is first tried with a plain socket (refused or unreachable: an error at
    once), then the store is joined in a worker thread that is abandoned, still blocked, when the time is up.
    """
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, port), timeout=max(timeout_s, 0.001)):
            pass
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc) or type(exc).__name__)
        raise BroadcastError(f"receiver rank {rank}: cannot connect to a weight sender at {where} ({reason})") from None
    outcome: dict[str, Any] = {}

    def join() -> None:
        left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        try:
            store = scoped(dist.TCPStore(host, port, None, False, left), token)
            store.wait([KEY + "sender"], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            outcome["sender"] = json.loads(store.get(KEY + "sender"))
            outcome["store"] = store
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    worker = threading.Thread(target=join, name=f"vlmreg-receiver-join {where}", daemon=True)
    worker.start()
    worker.join(max(deadline - time.monotonic(), 0.0))
    if worker.is_alive():
        raise BroadcastError(
            f"receiver rank {rank}: no weight sender answered at {where} within {timeout_s:g} s "
            f"(something listens there, but it is not a vlmreg weight sender with this token ({TOKEN_ENV} or token= "
            "must be the sender's), or it is stalled)"
        )
    if "store" in outcome:
        return outcome["store"], outcome["sender"]
    error = outcome.get("error")
    if isinstance(error, (store_failed(), ValueError, KeyError)):
        first = " ".join(str(error).split("\n", 1)[0].split())[:300]
        raise BroadcastError(
            f"receiver rank {rank}: no weight sender at {where} within {timeout_s:g} s with this token "
            f"(the token must be the sender's: token= or {TOKEN_ENV}) ({first})"
        ) from None
    raise error if error is not None else BroadcastError(f"receiver rank {rank}: joining {where} failed")
