"""`TensorStream`: a sync's tensors, taken from the plan one at a time as the bucket packer reaches them.

An FSDP2 trainer's weights are shards: each tensor a sync sends is first gathered to the sending rank
(`vlmreg.broadcast.shard_gather`, a collective). Taken all at once before the first bucket leaves, the sending rank
holds a second copy of the whole model (61 GB for the 30B-A3B shape) and nothing is on the wire until the last
gather is done. Taken as the packer reaches them (and `AHEAD` more), only the tensors of the buckets in flight are
held, and a bucket's gathers can run while the buckets before it are on the wire (the gathers use the trainer's
process group, the broadcast the weight group: two communicators, two streams).

The plan's names, shapes and dtypes are checked against the layout before anything is gathered or sent
(`vlmreg.broadcast.plan.WeightPlan.shapes` needs no gather); each tensor is checked again as it is taken. `drain`
takes whatever is left, so every trainer rank issues the same gathers in the same order even when a sync stops
early (the other ranks gather every tensor of the plan, `vlmreg.inference.server_link`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from vlmreg.broadcast.buckets import checked_pair, plan_exhausted
from vlmreg.broadcast.errors import BroadcastError

__all__ = ["AHEAD", "TensorStream"]

#: Tensors gathered ahead of the one being packed. A gather waits for everything queued on the stream before it; taken
#: only when its first bytes are packed, each would wait for the previous tensor's packing copy, so gathers and copies
#: would take turns (the sharded syncs measured on 2026-11-27 fit that: raw broadcast + every gather, one after the
#: other). Taken ahead, a gather runs beside the copies of the tensors before it.
AHEAD = 2


class TensorStream:
    """Index ``i`` of a sync's tensors, taken in order from ``pairs`` ((name, tensor), the plan's order) and checked
    against ``signature`` ((name, shape, dtype) per tensor, the layout's); `release_before` lets go of earlier ones."""

    def __init__(
        self,
        pairs: Iterable[tuple[str, torch.Tensor]],
        signature: Sequence[tuple[str, torch.Size, torch.dtype]],
        ahead: int = 0,
    ) -> None:
        """``ahead``: take that many more tensors than asked for (`AHEAD`, for gathered ones)."""
        self._pairs: Iterator[tuple[str, torch.Tensor]] = iter(pairs)
        self._ahead = ahead
        self._signature = signature
        self._held: dict[int, torch.Tensor] = {}
        self._taken = 0

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
        while self._taken <= min(index + self._ahead, len(self._signature) - 1):
            self._take()
        if index not in self._held:
            raise BroadcastError(f"tensor {self._signature[index][0]!r} was asked for after it was released")
        return self._held[index]

    def _take(self) -> None:
        self._held[self._taken] = checked_pair(next(self._pairs, None), *self._signature[self._taken])
        self._taken += 1

    def release_before(self, index: int) -> None:
        """Let go of the tensors before ``index`` (their buckets are packed or queued; a queued broadcast keeps what
        it reads alive until it completes)."""
        for i in [i for i in self._held if i < index]:
            del self._held[i]

    def drain(self) -> None:
        """Take every tensor not yet taken, and let all of them go; then the plan must be exhausted."""
        self._held.clear()
        while self._taken < len(self._signature):
            self._take()
            self._held.clear()
        plan_exhausted(self._pairs)
