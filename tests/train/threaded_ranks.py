"""Several ranks in one process: torch's threaded process group (one thread per rank, real collectives between the
threads: all-gather, reduce-scatter, FSDP2's own), so a test calls the sharded code directly and mutmut can see
which test reaches which function. The torchrun tests stay the multi-process reference; this is the in-process one.

``torch.testing._internal.distributed.multi_threaded_pg`` is torch's own backend for its FSDP2 and DTensor tests
(``MultiThreadedTestCase``): it swaps ``torch.distributed``'s global state for a per-thread one while installed.
`threaded_world` installs it for one test and takes it out again, so nothing leaks into the next test.

One process-wide state is shared by the ranks here as it never is under torchrun: the current directory, torch's
and Python's global RNG, and a module attribute that a test patches. Tests that need a rank to see something of its
own give it its own path or look at ``dist.get_rank()`` (per thread).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)

from vlmreg.train.distributed import Distributed

#: seconds a run of the ranks may take; a rank left waiting in a collective (one rank skipped it) fails the test
TIMEOUT = 60.0

Ranks = Callable[..., list[Any]]


class RankFailed(AssertionError):
    """A rank's function raised (or the ranks hung); the message names the rank."""


@contextmanager
def threaded_world() -> Iterator[Ranks]:
    """``run(fn, world=2)``: ``fn(ctx, mesh)`` on ``world`` threads, one rank each, in a fresh threaded process group
    (destroyed when ``fn`` returns); returns each rank's result, by rank, or raises the first rank's error."""
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        yield _run
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)


def _run(fn: Callable[[Distributed, DeviceMesh], Any], world: int = 2) -> list[Any]:
    store = dist.HashStore()
    results: list[Any] = [None] * world
    errors: dict[int, BaseException] = {}

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            mesh = init_device_mesh("cpu", (world,))
            results[rank] = fn(Distributed(rank=rank, world=world, device=torch.device("cpu")), mesh)
        except BaseException as exc:  # noqa: BLE001 (reported below, by rank)
            errors[rank] = exc
            ProcessLocalGroup.exception_handle(exc)  # wakes the other ranks out of their collectives
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    hung = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if hung:
        ProcessLocalGroup.exception_handle(TimeoutError())
        for thread in threads:
            thread.join(5)
    ProcessLocalGroup.reset()
    # a rank woken by another's failure exits with SystemExit: the first real error is the one to show
    real = {rank: exc for rank, exc in errors.items() if not isinstance(exc, SystemExit)}
    if real:
        rank, exc = min(real.items())
        raise RankFailed(f"rank {rank} of {world}: {type(exc).__name__}: {exc}") from exc
    if hung or errors:
        raise RankFailed(f"ranks {hung or sorted(errors)} of {world} did not finish within {TIMEOUT} s")
    return results
