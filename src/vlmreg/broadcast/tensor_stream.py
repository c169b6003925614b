"""`TensorStream`: a sync's tensors, taken from the plan one at a time as the bucket packer reaches them.

An FSDP2 trainer's weights are shards: each tensor a sync sends is first gathered to the sending rank
(`vlmreg.broadcast.shard_gather`, a collective). Taken all at once before the first bucket leaves, the sending rank
holds a second copy of the whole model (61 GB for the 30B-A3B shape) and nothing is on the wire until the last
gather is done. Taken as the packer reaches them, plus up to ``ahead_bytes`` more (`AHEAD_BYTES`), only the tensors
of the buckets in flight are held, and later buckets' gathers run while earlier buckets are on the wire.

On a GPU the gathers are issued on their own stream (``stream``). A collective waits for everything queued on the
stream it is issued from; issued from the stream that packs the buckets, each gather would wait for the packing
copies before it, and those wait for the broadcasts that free their ring slot, so gathers and broadcasts would take
turns (the sharded syncs measured on 2026-11-27 fit that: the raw broadcast plus every gather, one after the other).
On their own stream the gathers wait only for each other. The packing stream waits for a tensor's gather when it is
first asked for (`__getitem__`), and the tensor is marked as used there (``record_stream``), so its memory is not
reused before the copies and broadcasts that read it are done. So that the gathers do not run further ahead than
that in memory, a take waits (on the CPU) until the packing stream is past tensors released more than
``ahead_bytes`` ago.

The plan's names, shapes and dtypes are checked against the layout before anything is gathered or sent
(`vlmreg.broadcast.plan.WeightPlan.shapes` needs no gather); each tensor is checked again as it is taken. `drain`
takes whatever is left, so every trainer rank issues the same gathers in the same order even when a sync stops
early (the other ranks gather every tensor of the plan, `vlmreg.inference.server_link`), and makes the packing
stream wait for the gathers, which read the trainer's shards that the optimizer writes next.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from vlmreg.broadcast.buckets import checked_pair, plan_exhausted
from vlmreg.broadcast.errors import BroadcastError

__all__ = ["AHEAD_BYTES", "TensorStream"]

#: Bytes of tensors gathered ahead of the one being packed: four of the default 512 MB buckets.
AHEAD_BYTES = 2 * 2**30


class TensorStream:
    """Index ``i`` of a sync's tensors, taken in order from ``pairs`` ((name, tensor), the plan's order) and checked
    against ``signature`` ((name, shape, dtype) per tensor, the layout's); `release_before` lets go of earlier ones."""

    def __init__(
        self,
        pairs: Iterable[tuple[str, torch.Tensor]],
        signature: Sequence[tuple[str, torch.Size, torch.dtype]],
        ahead_bytes: int = 0,
        stream: Any = None,
    ) -> None:
        """``ahead_bytes``: take up to that many bytes of tensors beyond the one asked for (`AHEAD_BYTES`, for
        gathered ones); ``stream``: a CUDA stream to take them on (gathers), which first waits for the current one."""
        self._pairs: Iterator[tuple[str, torch.Tensor]] = iter(pairs)
        self._ahead = ahead_bytes
        self._signature = signature
        self._sizes = [shape.numel() * dtype.itemsize for _, shape, dtype in signature]
        self._held: dict[int, torch.Tensor] = {}
        self._taken = 0
        self._stream = stream
        self._gathered: dict[int, Any] = {}  # index -> event recorded on ``stream`` after its take
        self._released: deque[tuple[Any, int]] = deque()  # (event on the packing stream, bytes released before it)
        self._released_bytes = 0
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))  # the shards as the optimizer left them

    @classmethod
    def taken(
        cls, tensors: list[torch.Tensor], signature: Sequence[tuple[str, torch.Size, torch.dtype]]
    ) -> TensorStream:
        """A stream of tensors already taken and checked (`vlmreg.broadcast.buckets.Layout.check`)."""
        stream = cls((), signature)
        stream._held, stream._taken = dict(enumerate(tensors)), len(tensors)
        return stream

    def __len__(self) -> int:
        return len(self._signature)

    def __getitem__(self, index: int) -> torch.Tensor:
        if index < 0 or index >= len(self._signature):
            raise IndexError(index)
        while self._taken <= index:
            self._take()
        while self._taken < len(self._signature) and self._held_after(index) + self._sizes[self._taken] <= self._ahead:
            self._take()
        if index not in self._held:
            raise BroadcastError(f"tensor {self._signature[index][0]!r} was asked for after it was released")
        tensor = self._held[index]
        event = self._gathered.pop(index, None)
        if event is not None and tensor.is_cuda:
            current = torch.cuda.current_stream(tensor.device)
            current.wait_event(event)
            tensor.record_stream(current)  # read there and by the broadcasts that stream waits for: not reused before
        return tensor

    def _held_after(self, index: int) -> int:
        return sum(self._sizes[i] for i in self._held if i > index)

    def _take(self) -> None:
        index = self._taken
        if self._stream is None:
            self._held[index] = checked_pair(next(self._pairs, None), *self._signature[index])
        else:
            while self._released and self._released_bytes + self._sizes[index] > self._ahead:
                event, nbytes = self._released.popleft()
                event.synchronize()  # the packing stream is past those tensors: their memory can be reused
                self._released_bytes -= nbytes
            with torch.cuda.stream(self._stream):
                pair = next(self._pairs, None)
                self._gathered[index] = torch.cuda.Event()
                self._gathered[index].record(self._stream)
            self._held[index] = checked_pair(pair, *self._signature[index])
        self._taken += 1

    def release_before(self, index: int) -> None:
        """Let go of the tensors before ``index`` (their buckets are packed or queued; a queued broadcast keeps what
        it reads alive until it completes)."""
        released = [i for i in self._held if i < index]
        for i in released:
            del self._held[i]
            self._gathered.pop(i, None)
        if self._stream is not None and released:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._stream.device))
            nbytes = sum(self._sizes[i] for i in released)
            self._released.append((event, nbytes))
            self._released_bytes += nbytes

    def drain(self) -> None:
        """Take every tensor not yet taken, and let all of them go; then the plan must be exhausted, and the current
        stream waits for every take's stream."""
        self._held.clear()
        self._gathered.clear()
        self._released.clear()
        self._released_bytes = 0
        while self._taken < len(self._signature):
            self._take()
            self._held.clear()
            self._gathered.clear()
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        plan_exhausted(self._pairs)
