"""The inference side of the process-group transport (`vlmreg.broadcast.transport` has the protocol): `Receiver` joins
the sender's group, checks its layouts, and takes each sync into staging buffers; `Incoming` is one sync in flight.

A sync can be taken whole (`Receiver.receive`) or bucket by bucket (`Receiver.begin`): every bucket's receive is
posted at once, and `Incoming.wait` returns once bucket ``k`` has arrived (on a GPU: once the current stream waits for
it, so work queued after it runs behind that bucket while the next ones still arrive), so a caller can copy what
each bucket completes while the rest is in flight. Once it has applied a sync, the receiver may confirm it through
the store (`Receiver.confirm`, ``done/<rank>/<n>`` with a small JSON record), which the sender reads
(`vlmreg.broadcast.transport.Sender.confirmed`) without waiting for anything else the receiver answers.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Self

import torch

from vlmreg.broadcast.buckets import Layout, bucket_checksum, dtype_name
from vlmreg.broadcast.errors import BroadcastError, LayoutMismatchError, SenderClosed
from vlmreg.broadcast.group import (
    FOREVER,
    KEY,
    TOKEN_ENV,
    broadcast,
    device_for,
    identity,
    join_group,
    join_store,
    shutdown_group,
    store_failed,
)
from vlmreg.broadcast.plan import receiving_plan
from vlmreg.resolution import ResolvedFamily

__all__ = ["Incoming", "Receiver"]


class Incoming:
    """One sync being received: every bucket's receive is posted; its tensors are views into the staging buffers, whose
    bytes are final once the bucket that ends them has arrived.

    ``tensors``: checkpoint name -> view; ``ranges``: per bucket, (staging storage address, first byte, end byte),
    what `vlmreg.broadcast.bucket_replay` sorts copies by; ``early``: whether bytes may be used before `finish` (not
    with checksums, which are verified only once every bucket is in).
    """

    def __init__(
        self, receiver: Receiver, n: int, header: dict[str, Any], buckets: list[torch.Tensor], views: dict
    ) -> None:
        self.receiver, self.n, self.step = receiver, n, header.get("step")
        self.layout: Layout = receiver.layouts[header["layout"]]
        self.buckets, self.tensors = buckets, dict(views)
        self.ranges = staged_ranges(buckets)
        self._works = [broadcast(receiver.process_group, bucket) for bucket in buckets]
        self._sums = torch.empty(len(buckets), dtype=torch.int64, device=receiver.device) if receiver.checksum else None
        if self._sums is not None:
            self._works.append(broadcast(receiver.process_group, self._sums))
        self._local: list[torch.Tensor] = []
        self._arrived = 0  # buckets waited for, in order
        self.early = self._sums is None

    def wait(self, index: int) -> None:
        """Return once buckets ``0..index`` have arrived (on a GPU: the current stream waits for them)."""
        try:
            while self._arrived <= index:
                self._works[self._arrived].wait()
                if self._sums is not None:  # on GPU this overlaps the transfer of the next buckets
                    self._local.append(bucket_checksum(self.buckets[self._arrived]))
                self._arrived += 1
        except store_failed() as exc:
            raise BroadcastError(
                f"receiver rank {self.receiver.rank}: sync {self.n} failed during the transfer ({exc})"
            ) from exc

    def finish(self) -> dict[str, torch.Tensor]:
        """Wait for every bucket (and the checksums), check them, and give the tensors by checkpoint name."""
        self.wait(len(self.buckets) - 1)
        try:
            if self._works:
                self._works[-1].wait()
        except store_failed() as exc:
            raise BroadcastError(
                f"receiver rank {self.receiver.rank}: sync {self.n} failed during the transfer ({exc})"
            ) from exc
        self.receiver._syncs = self.n
        if self._sums is not None:
            bad = (torch.stack(self._local) != self._sums).nonzero().flatten().tolist()
            if bad:
                names = self.layout.names_in_bucket(bad[0])
                raise BroadcastError(
                    f"receiver rank {self.receiver.rank}: checksum mismatch in bucket {bad[0]} of sync {self.n} "
                    f"({len(bad)} bad bucket(s); first holds {', '.join(names[:3])}); the weights were not handed over"
                )
        self.receiver.last_step = self.step
        return dict(self.tensors)


class Receiver:
    """Inference side (rank >= 1): checks the sender's layouts against its own model, then receives syncs.

    Received tensors live in buffers allocated once per layout and reused, one per dtype region; `receive`
    returns views into them by checkpoint name, valid until the next `receive`. Pass them to `apply_weights`.
    """

    def __init__(
        self,
        resolved: ResolvedFamily | None,
        *,
        host: str,
        port: int,
        rank: int,
        backend: str = "gloo",
        device: torch.device | str | None = None,
        timeout_s: float = 120.0,
        token: str | None = None,
    ) -> None:
        token = token or os.environ.get(TOKEN_ENV)
        if not token:
            raise BroadcastError(
                f"receiver rank {rank}: no weight token; pass the sender's token (token=, or {TOKEN_ENV} in the "
                "environment)"
            )
        deadline = time.monotonic() + timeout_s  # joining the store and then the group, all within timeout_s
        self.rank, self.backend, self.device = rank, backend, device_for(backend, device)
        self.timeout_s = timeout_s
        self._timeout = timedelta(seconds=timeout_s)
        where = f"{host}:{port}"
        self._aborted: str | None = None
        self._store: Any
        self._store, sender = join_store(host, port, rank, timeout_s, token)
        world = sender["world_size"]
        if not 1 <= rank < world:
            raise BroadcastError(f"receiver rank {rank}: the sender at {where} expects ranks 1..{world - 1}")
        if sender["backend"] != backend:
            self._reject(f"backend {backend!r} here, {sender['backend']!r} on the sender")
        self.checksum = bool(sender["checksum"])
        self.layouts = [Layout.from_json(self._store.get(f"{KEY}layout/{i}")) for i in range(sender["layouts"])]
        if resolved is not None:  # None: an engine that checks names itself (vLLM's load_weights)
            plan = receiving_plan(resolved)  # with the adapters of a model that serves LoRA
            expected = {name: (tuple(t.shape), dtype_name(t.dtype)) for name, t in plan.shapes()}
            for index, layout in enumerate(self.layouts):
                problem = layout.mismatch(expected, complete=index == 0)
                if problem is not None:
                    self._reject(f"{problem} (receiving {resolved.name} model)")
        self._store.set(f"{KEY}hello/{rank}", json.dumps({"rank": rank, **identity()}))
        self._group = None
        try:
            self._store.wait([KEY + "connecting"], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except store_failed():
            reason = (
                f"receiver rank {rank}: the weight sender at {where} did not start the {backend} process group within "
                f"{timeout_s:g} s (it never called connect(), or it is stalled or gone)"
            )
            self.abort(reason)  # a sender that connects later fails at once instead of waiting for this receiver
            raise BroadcastError(reason) from None

        def failed(reason: str) -> BroadcastError:
            return BroadcastError(
                f"receiver rank {rank}: the {backend} weight group at {where} was not complete within {timeout_s:g} s "
                f"(the sender or another receiver died or stalled while joining) ({reason})"
            )

        self._group = join_group(backend, self._store, rank, world, self._timeout, self.device, failed)
        self._syncs = 0
        self._staging: tuple[int, list[torch.Tensor], dict[str, torch.Tensor]] | None = None
        self.last_step: int | None = None

    def _reject(self, problem: str) -> None:
        self._store.set(f"{KEY}error/{self.rank}", json.dumps({"error": problem, **identity()}))
        raise LayoutMismatchError(f"receiver rank {self.rank}: {problem}; nothing was received or applied")

    def abort(self, reason: str) -> None:
        """Tell the sender this receiver gave up (it posts ``error/<rank>``), then release the group.

        Call it when something fails here between syncs (the engine could not load, a `receive` failed, the caller
        hit an error): the sender's waiting `connect` or `send` then raises at once with ``reason``, naming this
        rank, host and pid, instead of waiting its whole timeout. Leaving a ``with Receiver(...)`` block by an
        exception other than `SenderClosed` calls it. Calling it twice, or after the sender is gone, does nothing.
        """
        if self._aborted is not None:
            return
        self._aborted = " ".join(str(reason).split()) or "no reason given"
        try:
            self._store.set(
                f"{KEY}error/{self.rank}", json.dumps({"error": self._aborted, "aborted": True, **identity()})
            )
        except store_failed():
            pass  # the sender is gone already: nobody to tell
        self.close()

    @property
    def process_group(self) -> Any:
        return self._group

    def _buffers(self, layout_id: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        if self._staging is None or self._staging[0] != layout_id:
            self._staging = None
            layout = self.layouts[layout_id]
            regions = [torch.empty(r.nbytes, dtype=torch.uint8, device=self.device) for r in layout.regions]
            self._staging = (layout_id, layout.bucket_views(regions), layout.region_views(regions))
        return self._staging[1], self._staging[2]

    def begin(self, timeout_s: float | None = None) -> Incoming:
        """Post "ready", wait (``timeout_s``; ``None``: no limit) for the next sync's header, and post the receive of
        every bucket; the returned `Incoming` waits for them (`Incoming.wait`, `Incoming.finish`).

        Raises `SenderClosed` when the sender closed the channel, and `BroadcastError` when the sender is gone."""
        if self._aborted is not None:
            raise BroadcastError(f"receiver rank {self.rank} was aborted ({self._aborted}); create a new one")
        n = self._syncs + 1
        key = f"{KEY}sync/{n}"
        try:
            self._store.set(f"{KEY}ready/{self.rank}/{n}", "1")
            self._store.wait([key], timedelta(seconds=timeout_s) if timeout_s is not None else FOREVER)
            header = json.loads(self._store.get(key))
        except store_failed() as exc:
            raise BroadcastError(f"receiver rank {self.rank}: no sync {n} from the sender ({exc})") from None
        if header.get("closed"):
            raise SenderClosed(f"receiver rank {self.rank}: the sender closed the channel after {n - 1} sync(s)")
        buckets, views = self._buffers(header["layout"])
        return Incoming(self, n, header, buckets, views)

    def receive(self, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """Post "ready", wait (``timeout_s``; ``None``: no limit) for the next sync and receive it.

        Returns checkpoint name -> tensor. Raises `SenderClosed` when the sender closed the channel, and
        `BroadcastError` when a transfer fails or a checksum differs (the tensors are then not handed over).
        """
        return self.begin(timeout_s).finish()

    def confirm(self, record: dict[str, Any] | None = None) -> None:
        """Tell the sender the last sync received is applied (``done/<rank>/<n>``, with ``record``: JSON numbers such as
        this receiver's timings); the sender's `Sender.confirmed` turns true once every receiver has."""
        try:
            self._store.set(f"{KEY}done/{self.rank}/{self._syncs}", json.dumps(record or {}))
        except store_failed() as exc:
            raise BroadcastError(f"receiver rank {self.rank}: could not confirm sync {self._syncs} ({exc})") from None

    def close(self) -> None:
        shutdown_group(self._group, self.backend)
        self._group = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None and not isinstance(exc, SenderClosed):
            self.abort(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        self.close()


def staged_ranges(buckets: Sequence[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(storage address, first byte, end byte) of each bucket view: where its bytes sit in the staging buffers."""
    return [
        (b.untyped_storage().data_ptr(), int(b.storage_offset()), int(b.storage_offset()) + b.numel()) for b in buckets
    ]
