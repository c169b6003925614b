"""A copy plan replayed bucket by bucket, as a sync's buckets arrive, and the timing of a sync on its device.

`vlmreg.broadcast.copy_plan.CopyPlan` replays every copy at once, which a receiver can only do once the whole sync is
in. Here its copies are sorted by the bucket whose arrival completes their source (a copy reading bytes of buckets
``j..k`` belongs to ``k``), so the copies of bucket ``k`` run while buckets ``k + 1 ..`` are still arriving and only
the last bucket's copies are left after the transfer. The constant fills go first, before any copy, as
`CopyPlan.replay` orders them.

On a GPU the receiver's `vlmreg.broadcast.receiver.Incoming.wait` makes the current stream wait for bucket ``k``
(the NCCL stream keeps receiving the next ones), so the copies queued after it run on the current stream behind
that bucket alone; on a CPU the wait blocks the host, and the copies run while gloo's threads receive the rest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from vlmreg.broadcast.copy_plan import CopyPlan, PlanRefused, _grouped, _replay

__all__ = ["BucketReplay", "SyncClock", "bucket_of"]


def _extent(view: torch.Tensor) -> int:
    """Bytes from a view's first element to just past its last one."""
    if view.numel() == 0:
        return 0
    return view.element_size() * (1 + sum((n - 1) * s for n, s in zip(view.shape, view.stride(), strict=True)))


def bucket_of(view: torch.Tensor, ranges: Sequence[tuple[int, int, int]]) -> int:
    """The bucket whose arrival completes ``view``'s bytes: the one holding its last byte (``ranges``: per bucket,
    storage address, first byte, end byte). `PlanRefused` when no bucket holds it (a source outside the staging)."""
    if view.numel() == 0:
        return 0
    storage = view.untyped_storage().data_ptr()
    first = view.data_ptr() - storage
    last = first + _extent(view) - 1
    start_bucket = None
    for index, (address, start, end) in enumerate(ranges):
        if address != storage:
            continue
        if start <= first < end:
            start_bucket = index
        if start <= last < end:
            if start_bucket is None:
                break
            return index
    raise PlanRefused("a recorded copy reads bytes outside the sync's buckets")


class BucketReplay:
    """``plan``'s copies grouped by bucket (``ranges`` as `bucket_of` takes them); `run` replays one bucket's group."""

    def __init__(self, plan: CopyPlan, ranges: Sequence[tuple[int, int, int]]) -> None:
        self.plan, self.ranges = plan, tuple(ranges)
        groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.ranges]
        for dst, src in plan.copies:
            groups[bucket_of(src, self.ranges)].append((dst, src))
        self.counts = [len(group) for group in groups]
        self.steps = [_grouped(group) if group else (None, []) for group in groups]

    def run(self, index: int) -> None:
        """Queue (on a GPU) or make (on a CPU) the copies that bucket ``index`` completes; the fills with bucket 0."""
        chunked, groups = self.steps[index]
        _replay(self.plan.fills if index == 0 else (), chunked, groups)


class SyncClock:
    """Named instants of one sync on its device: CUDA events recorded on the current stream on a GPU (what the stream
    has reached, not when the host queued it), host times on a CPU. Read them with `seconds` once the stream is
    synchronized."""

    def __init__(self, device: Any) -> None:
        self.cuda = getattr(device, "type", None) == "cuda" and torch.cuda.is_available()
        self.marks: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def seconds(self, start: str, end: str) -> float:
        a, b = self.marks[start], self.marks[end]
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a
