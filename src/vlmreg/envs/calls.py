"""Calling many environments at once: a turn's ``reset`` / ``step`` calls run concurrently, bounded, each timed.

An environment method may be a plain function or an ``async def``. Coroutines are awaited on vlmreg's environment
event loop (one daemon thread for the process, so a client session an environment keeps stays on one loop); plain
calls run on a thread pool from that loop. At most ``concurrency`` calls are in flight; each must finish within
``timeout_s``. The first failure (or timeout) cancels what has not started and raises `EnvironmentFailure`, naming
the environment, the call and the episode. A plain call that overruns its timeout cannot be stopped: its thread is
left to finish on its own while the error is raised.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import os
import threading
from collections.abc import Sequence
from typing import Any

import attrs

from vlmreg.gather import gather_all
from vlmreg.sdk.errors import RewardError, VlmregError

__all__ = [
    "EnvCall",
    "EnvironmentFailure",
    "call_environments",
    "close_environments",
    "environment_name",
    "first_messages",
]

_POOL_THREADS = 64


class EnvironmentFailure(VlmregError):
    """An environment raised, timed out or answered wrongly; the message names it, the call and the episode."""


def environment_name(env: Any) -> str:
    """How errors name an environment: its ``name`` attribute (a remote one says where it is), else its class."""
    name = getattr(env, "name", None)
    return name if isinstance(name, str) and name else type(env).__name__


@attrs.frozen
class EnvCall:
    """One call to make: ``env.<method>(*args)`` for the episode ``episode`` (its example id) at position ``index``."""

    env: Any
    method: str
    args: tuple[Any, ...]
    episode: str
    index: int = 0


_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_owner: tuple[int, threading.Thread] | None = None
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _runtime() -> tuple[asyncio.AbstractEventLoop, concurrent.futures.ThreadPoolExecutor]:
    """The environment loop (a daemon thread) and the pool for plain calls, started on first use (again after fork)."""
    global _loop, _owner, _pool
    with _lock:
        alive = _owner is not None and _owner[0] == os.getpid() and _owner[1].is_alive()
        if not alive or _loop is None or _pool is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="vlmreg-environments", daemon=True)
            thread.start()
            _loop, _owner = loop, (os.getpid(), thread)
            _pool = concurrent.futures.ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="vlmreg-env")
        return _loop, _pool


def _is_async(method: Any) -> bool:
    return inspect.iscoroutinefunction(method) or inspect.iscoroutinefunction(getattr(method, "__func__", None))


def _failure(call: EnvCall, what: str, exc: BaseException | None = None) -> EnvironmentFailure:
    name = environment_name(call.env)
    if exc is None:
        return EnvironmentFailure(f"{name}.{call.method} failed on {call.episode}: {what}")
    return EnvironmentFailure(f"{name}.{call.method} failed on {call.episode}: {type(exc).__name__}: {exc}")


def _wrap(call: EnvCall, exc: BaseException) -> BaseException:
    """The error to raise for ``exc``: a reward error names the sample; vlmreg's own errors pass; others are wrapped."""
    if isinstance(exc, RewardError):
        return exc.on_sample(call.index, call.episode)
    if isinstance(exc, EnvironmentFailure):
        return exc
    if isinstance(exc, VlmregError):  # a remote environment's own error already names the server: add the episode
        return EnvironmentFailure(f"{environment_name(call.env)}.{call.method} failed on {call.episode}: {exc}")
    return _failure(call, "", exc)


async def _plain(loop: asyncio.AbstractEventLoop, pool: Any, method: Any, args: tuple[Any, ...]) -> Any:
    """A plain method on the pool; if it hands back an awaitable (a wrapped coroutine function), that is awaited too."""
    result = await loop.run_in_executor(pool, functools.partial(method, *args))
    return await result if inspect.isawaitable(result) else result


async def _gather(
    calls: Sequence[EnvCall], timeout_s: float | None, concurrency: int, pool: Any, setting: str, keep_going: bool
) -> list[Any]:
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(concurrency)

    async def one(call: EnvCall) -> Any:
        async with gate:
            try:
                method = getattr(call.env, call.method)
                work = method(*call.args) if _is_async(method) else _plain(loop, pool, method, call.args)
                return await asyncio.wait_for(work, timeout_s)
            except TimeoutError:
                raise _failure(call, f"no answer within {timeout_s:g} s ({setting})") from None
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # a reward error keeps its own cause (the reward's exception)
                raise _wrap(call, exc) from (exc.__cause__ if isinstance(exc, RewardError) else exc)

    tasks = [asyncio.ensure_future(one(call)) for call in calls]
    if keep_going:
        return list(await asyncio.gather(*tasks, return_exceptions=True))
    return await gather_all(tasks)


def call_environments(
    calls: Sequence[EnvCall],
    *,
    timeout_s: float | None = None,
    concurrency: int = 32,
    setting: str = "rollout.env_timeout_s",
    keep_going: bool = False,
) -> list[Any]:
    """Each call's result, in order; the calls run concurrently (at most ``concurrency`` at once), each within
    ``timeout_s`` (``None``: no limit; ``setting`` names where it is set, for the error). The first failure raises
    `EnvironmentFailure` (or the reward's `RewardError`) and cancels the rest; with ``keep_going``, every call runs and
    a failed one's error is its result instead."""
    if not calls:
        return []
    loop, pool = _runtime()
    if _owner is not None and threading.current_thread() is _owner[1]:
        raise VlmregError("run_episodes was called from inside an environment's own call; that would wait for itself")
    future = asyncio.run_coroutine_threadsafe(
        _gather(calls, timeout_s, max(1, concurrency), pool, setting, keep_going), loop
    )
    return future.result()


def close_environments(envs: Sequence[Any]) -> None:
    """Call ``close()`` on every environment that has one (errors ignored: the episode is over either way)."""
    calls = [EnvCall(env, "close", (), "close") for env in envs if callable(getattr(env, "close", None))]
    if not calls:
        return
    call_environments(calls, timeout_s=30.0, keep_going=True)  # each close on its own; failures ignored


def first_messages(env: Any, example: Any, *, timeout_s: float | None = None) -> Any:
    """``env.reset(example)`` (plain or ``async def``), then ``close``: for code that needs only an episode's prompt
    (the format warm-up, ``vlmreg data preview``)."""
    try:
        return call_environments([EnvCall(env, "reset", (example,), example.id)], timeout_s=timeout_s)[0]
    finally:
        close_environments([env])
