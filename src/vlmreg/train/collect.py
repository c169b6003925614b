"""Rollout batches as values, and collecting them ahead of training.

A step is two values: `RolloutBatch` (what ``Trainer.collect`` returns: the episodes, the policy version that
sampled them, where the example source stood after taking them) and the step's record (what ``Trainer.update``
returns). With ``[trainer] max_off_policy_steps = 0`` the trainer collects a batch, updates on it, syncs the
server, and so on: every sample comes from the policy being trained. With ``N >= 1`` (a server engine only),
`AheadCollector` collects in a background thread while the trainer updates, under two rules that make every
batch's policy version exact and deterministic:

- batch ``t`` (trained by the policy after ``t - 1`` updates) is sampled from the weights of update
  ``max(t - 1 - N, v0)``, ``v0`` being the version the server held when training (re)started: its collection
  starts only once the server holds that version;
- the sync of version ``v`` waits until batch ``v + N`` is collected (a sync never lands in the middle of a batch,
  and never before the batches that must come from older weights).

So batch ``t`` is ``t - 1 - version <= N`` updates behind the policy that trains on it (exactly ``N`` once the
pipeline is full), each update overlaps with collecting a later batch, and the importance weights (TIS) correct
for the gap.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from vlmreg.rollout.episodes import Trajectory

__all__ = ["AheadCollector", "RolloutBatch"]


@attrs.frozen(eq=False)
class RolloutBatch:
    """The episodes of one trainer step, and where they came from."""

    step: int  # the trainer step that trains on them
    trajectories: list[Trajectory]
    policy_version: int  # how many optimizer steps the sampling weights had taken (0: the initial policy)
    rollout_s: float  # wall time of the collection
    # the example source just after this batch took its examples
    source_state: dict[str, Any] = attrs.field(factory=dict)
    per_server: tuple[int, ...] = ()  # completions each rollout server returned for this batch (several servers only)

    @property
    def off_policy_steps(self) -> int:
        """Updates between the sampling policy and the one that trains on the batch (0: on-policy)."""
        return self.step - 1 - self.policy_version


class AheadCollector:
    """Collects batches ``first..last`` in a background thread, at most ``ahead`` policy versions behind.

    ``collect(step, version)`` makes one batch; it runs in the collector's thread only, one at a time, in step order.
    ``version`` is the policy version the server holds at the start (the last synced update). The trainer takes
    batches with `get`, and wraps every weight sync in `sync` and everything else that uses the server (an
    evaluation) in `exclusive`. An exception in ``collect`` is raised again by the trainer's next `get`, `sync` or
    `exclusive`.
    """

    def __init__(
        self, collect: Callable[[int, int], RolloutBatch], *, first: int, last: int, ahead: int, version: int
    ) -> None:
        if ahead < 1:
            raise ValueError("AheadCollector needs ahead >= 1 (0 is the synchronous loop)")
        self._collect, self.first, self.last, self.ahead = collect, first, last, ahead
        self._floor = version  # batches never wait for a version older than the one training starts from
        self._version = version
        self._ready: dict[int, RolloutBatch] = {}
        self._collected = first - 1  # the last step collected
        self._busy = False  # a collection is in flight
        self._held = False  # the trainer holds the server (a sync or an evaluation)
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="vlmreg-collector", daemon=True)
        self._thread.start()

    def wanted_version(self, step: int) -> int:
        """The policy version batch ``step`` is sampled from."""
        return max(step - 1 - self.ahead, self._floor)

    def _run(self) -> None:
        for step in range(self.first, self.last + 1):
            wanted = self.wanted_version(step)
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (self._version >= wanted and not self._held))  # noqa: B023 - called now
                if self._closed:
                    return
                self._busy, version = True, self._version
            try:
                batch = self._collect(step, version)
            except BaseException as exc:  # handed to the trainer's thread, which raises it
                with self._cond:
                    self._error, self._busy = exc, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[step], self._collected, self._busy = batch, step, False
                self._cond.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def get(self, step: int) -> RolloutBatch:
        """Batch ``step``, waiting for it if it is still being collected."""
        with self._cond:
            self._cond.wait_for(lambda: step in self._ready or self._error is not None or self._closed)
            if step in self._ready:
                return self._ready.pop(step)
            self._raise_error()
            raise RuntimeError(f"the rollout collector was closed before batch {step}")

    @contextlib.contextmanager
    def exclusive(self, *, collected: int | None = None) -> Iterator[None]:
        """Hold the server: no collection is in flight for the duration (and, with ``collected``, every batch up to
        that step, or the last one, has been collected first)."""
        target = min(collected, self.last) if collected is not None else None
        with self._cond:
            self._cond.wait_for(
                lambda: self._error is not None or (not self._busy and (target is None or self._collected >= target))
            )
            self._raise_error()
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    @contextlib.contextmanager
    def sync(self, version: int) -> Iterator[None]:
        """Around the weight sync of ``version``: it starts once batch ``version + ahead`` is collected; batches
        waiting for ``version`` start after it."""
        with self.exclusive(collected=version + self.ahead):
            yield
            with self._cond:  # still held: the collector sees the new version once the sync is over
                self._version = version

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop collecting: a collection in flight is left to finish (its thread is a daemon) within ``timeout_s``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
