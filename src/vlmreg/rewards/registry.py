"""Reward functions by name, and `combine`, which turns a ``{name: weight}`` table into one reward.

The names are the reward registry's (`vlmreg.get_reward_registry`), filled through ``vlmreg_register_rewards``: the
bundled ones from the built-in plugin `vlmreg.builtin.rewards`, others from any installed plugin. A reward function
is ``(completion: str, answer) -> float``, or an ``async def`` of the same; an unknown name is an
`UnknownRewardError` with a suggestion.

Synchronous functions are called inline, as plain calls. Asynchronous ones are awaited on one event loop that vlmreg
runs in a daemon thread for the whole process (so a client session a reward keeps stays on one loop), each call
bounded by its ``Reward.timeout_s``. `WeightedReward.prefetch` awaits the async functions of many samples at once,
at most ``max_concurrency`` calls in flight; the episode runner calls it for every turn of single-turn environments,
so a step's reward-model requests overlap. A function that raises, times out or returns no number is a
`RewardError` naming the reward and the sample.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import attrs

from vlmreg.gather import gather_all
from vlmreg.sdk.errors import RewardError, UnknownRewardError
from vlmreg.sdk.registry import get_reward_registry
from vlmreg.sdk.reward import Reward

__all__ = [
    "MAX_CONCURRENCY",
    "RewardError",
    "RewardFn",
    "UnknownRewardError",
    "WeightedReward",
    "combine",
    "get_reward",
    "reward_names",
    "unknown_reward_message",
]

RewardFn = Callable[[str, Any], float]
#: The most async reward calls `WeightedReward.prefetch` keeps in flight at once.
MAX_CONCURRENCY = 32


def reward_names() -> list[str]:
    """The names of the registered reward functions, sorted."""
    return get_reward_registry().names()


def unknown_reward_message(name: str) -> str:
    """``unknown reward 'x'. Did you mean 'y'? Rewards: ...``: the one wording used everywhere."""
    return get_reward_registry().unknown_message(name)


def get_reward(name: str) -> RewardFn:
    """The reward function called ``name`` as a plain callable, or `UnknownRewardError`.

    A synchronous one is the registered function itself; an async one is wrapped to run on vlmreg's event loop with
    its timeout (a failure is a `RewardError` naming it).
    """
    reward = get_reward_registry().get(name)
    if not reward.is_async:
        return reward.fn

    def call(completion: str, answer: Any) -> float:
        return _score(reward, True, completion, answer)

    call.__name__ = call.__qualname__ = reward.name
    return call


# -- the event loop for async rewards -----------------------------------------------------------------------
_loop_lock = threading.Lock()
_loop: Any = None  # asyncio.AbstractEventLoop, imported lazily: importing vlmreg.rewards stays cheap
_loop_owner: tuple[int, threading.Thread] | None = None


def _event_loop() -> Any:
    """vlmreg's reward event loop, started in a daemon thread on first use (again in a forked child)."""
    global _loop, _loop_owner
    # deferred: start-up cost (loads asyncio)
    import asyncio  # noqa: PLC0415

    with _loop_lock:
        alive = _loop_owner is not None and _loop_owner[0] == os.getpid() and _loop_owner[1].is_alive()
        if not alive:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="vlmreg-rewards", daemon=True)
            thread.start()
            _loop, _loop_owner = loop, (os.getpid(), thread)
        return _loop


def _run(make: Callable[[], Awaitable[Any]]) -> Any:
    """Run the coroutine ``make()`` on the reward loop and wait for it (from any thread but the loop's own)."""
    # deferred: start-up cost (loads asyncio)
    import asyncio  # noqa: PLC0415

    loop = _event_loop()
    if _loop_owner is not None and threading.current_thread() is _loop_owner[1]:
        raise RuntimeError(
            "a reward function called a vlmreg reward synchronously from inside an async reward; await it instead"
        )

    async def start() -> Any:
        return await make()

    return asyncio.run_coroutine_threadsafe(start(), loop).result()


async def _await(
    reward: Reward, completion: str, answer: Any, sample: int | None, example: str | None, awaitable: Any = None
) -> float:
    """One async call (or ``awaitable``, already made), bounded by ``reward.timeout_s``; a failure names the reward and
    the sample."""
    # deferred: start-up cost (loads asyncio)
    import asyncio  # noqa: PLC0415

    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        if awaitable is None:
            awaitable = reward.fn(completion, answer)
        value = await (awaitable if reward.timeout_s is None else asyncio.wait_for(awaitable, reward.timeout_s))
    except TimeoutError as exc:
        if reward.timeout_s is not None and loop.time() - started >= reward.timeout_s * 0.999:
            raise RewardError(
                reward.name, f"timed out after {reward.timeout_s:g} s (Reward.timeout_s)", completion, sample, example
            ) from exc
        raise RewardError(reward.name, f"raised {type(exc).__name__}: {exc}", completion, sample, example) from exc
    except Exception as exc:
        raise RewardError(reward.name, f"raised {type(exc).__name__}: {exc}", completion, sample, example) from exc
    return _number(reward, value, completion, sample, example)


def _number(
    reward: Reward, value: Any, completion: str, sample: int | None = None, example: str | None = None
) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise RewardError(reward.name, f"returned {value!r}, not a number", completion, sample, example) from None


def _score(reward: Reward, is_async: bool, completion: str, answer: Any) -> float:
    """One call of one reward: inline when synchronous, on the reward loop (with its timeout) when async."""
    if is_async:
        return _run(lambda: _await(reward, completion, answer, None, None))
    try:
        value = reward.fn(completion, answer)
    except Exception as exc:
        raise RewardError(reward.name, f"raised {type(exc).__name__}: {exc}", completion) from exc
    if type(value) is float:
        return value
    if inspect.isawaitable(value):  # a plain function that returned a coroutine: awaited like an async reward's
        return _run(lambda: _await(reward, completion, answer, None, None, awaitable=value))
    return _number(reward, value, completion)


# -- weighted sums ------------------------------------------------------------------------------------------
def _check_weights(instance: Any, attribute: attrs.Attribute, weights: Mapping[str, float]) -> None:
    if not weights:
        raise ValueError("combine() needs at least one reward name and weight")
    registry = get_reward_registry()
    unknown = [name for name in weights if name not in registry]
    if unknown:
        raise UnknownRewardError("; ".join(registry.unknown_message(name) for name in unknown))
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise TypeError(f"reward {name!r}: weight must be a number (got {weight!r})")


def _check_concurrency(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_concurrency must be a positive int (got {value!r})")


@attrs.frozen
class WeightedReward:
    """A weighted sum of named reward functions; call it like one reward function.

    The functions are looked up in the reward registry when it is built. ``prefetch`` scores the async functions of
    many samples concurrently; a later call with one of those completions and the very same answer object uses them.
    """

    weights: Mapping[str, float] = attrs.field(converter=lambda w: dict(w), validator=_check_weights)
    max_concurrency: int = attrs.field(default=MAX_CONCURRENCY, kw_only=True, validator=_check_concurrency)
    _parts: tuple[tuple[str, Reward, bool], ...] = attrs.field(init=False, eq=False, repr=False)
    _ready: dict[tuple[str, int], list[tuple[Any, dict[str, float]]]] = attrs.field(init=False, eq=False, repr=False)
    _ready_lock: Any = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        registry = get_reward_registry()
        parts = tuple((name, registry.get(name)) for name in self.weights)
        object.__setattr__(self, "_parts", tuple((name, reward, reward.is_async) for name, reward in parts))
        object.__setattr__(self, "_ready", {})  # (completion, id(answer)) -> [(answer, {name: score})]
        object.__setattr__(self, "_ready_lock", threading.Lock())

    @property
    def has_async(self) -> bool:
        """Whether any of the functions is async (then `prefetch` is worth calling)."""
        return any(is_async for _, _, is_async in self._parts)

    def scores(self, completion: str, answer: Any) -> dict[str, float]:
        """Each function's unweighted score, for logging next to the total."""
        ready = self._take(completion, answer) if self._ready else None
        if ready is None:
            return {name: _score(reward, is_async, completion, answer) for name, reward, is_async in self._parts}
        return {
            name: ready[name] if name in ready else _score(reward, is_async, completion, answer)
            for name, reward, is_async in self._parts
        }

    def __call__(self, completion: str, answer: Any) -> float:
        scores = self.scores(completion, answer)
        return float(sum(self.weights[name] * score for name, score in scores.items()))

    def prefetch(self, samples: Sequence[tuple[int, str, Any, str | None]]) -> None:
        """Await the async functions on every ``(index, completion, answer, example_id)`` at once.

        At most ``max_concurrency`` calls are in flight; each has its reward's timeout. The first failure cancels the
        rest and raises a `RewardError` naming the reward and the sample (its index and example). The scores wait
        for the calls that score the same completion against the same answer object; earlier unused ones are dropped.
        """
        with self._ready_lock:
            self._ready.clear()
        parts = [(name, reward) for name, reward, is_async in self._parts if is_async]
        if not parts or not samples:
            return
        samples = list(samples)
        limit = self.max_concurrency

        async def gather() -> list[float]:
            # deferred: start-up cost (loads asyncio)
            import asyncio  # noqa: PLC0415

            gate = asyncio.Semaphore(limit)

            async def one(reward: Reward, index: int, completion: str, answer: Any, example: str | None) -> float:
                async with gate:
                    return await _await(reward, completion, answer, index, example)

            tasks = [asyncio.ensure_future(one(reward, *sample)) for sample in samples for _, reward in parts]
            return await gather_all(tasks)

        values = iter(_run(gather))
        ready: dict[tuple[str, int], list[tuple[Any, dict[str, float]]]] = {}
        for _, completion, answer, _ in samples:
            ready.setdefault((completion, id(answer)), []).append((answer, {name: next(values) for name, _ in parts}))
        with self._ready_lock:
            self._ready.update(ready)

    def _take(self, completion: str, answer: Any) -> dict[str, float] | None:
        """The prefetched scores of this completion and answer (each used once), or ``None``."""
        key = (completion, id(answer))
        try:
            hash(key)
        except TypeError:
            return None
        with self._ready_lock:
            entries = self._ready.get(key)
            if not entries:
                return None
            for k, (kept, scores) in enumerate(entries):
                if kept is answer:
                    del entries[k]
                    if not entries:
                        del self._ready[key]
                    return scores
        return None


def combine(weights: Mapping[str, float], *, max_concurrency: int = MAX_CONCURRENCY) -> WeightedReward:
    """One reward: the sum of ``weight * function(completion, answer)`` over ``weights``; names are checked now."""
    return WeightedReward(weights, max_concurrency=max_concurrency)
