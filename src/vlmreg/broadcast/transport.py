"""Network transport: trainer rank 0 broadcasts weights to inference workers over a private process group.

The group is built directly from a `torch.distributed.TCPStore` (hosted by the sender) and
``ProcessGroupNCCL`` / ``ProcessGroupGloo``, never through ``init_process_group``, so a trainer running under
torchrun keeps its default group untouched. Rank 0 sends; receivers are ranks 1..R.

The store is open to anyone who reaches its port, so every key lives under a secret token: the sender's (``token=``,
else ``VLMREG_WEIGHTS_TOKEN``, else a random one), which a receiver must be given the same way. Without it a receiver
finds no sender, cannot read the layouts or join the process group, and cannot disturb a sync.

Protocol, all small messages through the store (keys under ``vlmreg/broadcast/<token>/``):

* the sender publishes its layouts once (``layout/<i>``: the full first-sync layout, and the per-step one) and
  ``sender`` (world size, backend, checksum);
* each receiver checks every layout against its own model before anything is received; it posts ``hello/<rank>``
  (host, pid) or ``error/<rank>`` with the first mismatching tensor, which the sender raises;
* once every receiver said hello, the sender posts ``connecting`` and builds its side of the process group; a
  receiver waits for ``connecting`` (what is left of its ``timeout_s``) before building its own, so a sender that
  never connects is an error naming its address within the receiver's timeout, and a receiver that said hello but
  never joins the group is one naming its rank and the address within the sender's ``timeout_s``;
* per sync ``n``, a receiver posts ``ready/<rank>/<n>`` when it enters `Receiver.receive`; the sender waits for
  all of them (``timeout_s``, then an error naming each missing receiver's rank, host and pid), posts
  ``sync/<n>`` (step, layout id) and broadcasts the buckets; checksums, when on, follow as one int64 tensor.
  While waiting it also polls ``error/<rank>``: `Receiver.abort` posts it (with ``"aborted": true``) when a
  receiver fails locally, and the sender raises at once with its reason. The wait polls every 0.1 ms for its first
  20 ms (a receiver's "ready" usually comes within a few ms of the request that told it to receive), then backs off;
* a receiver that has applied sync ``n`` may post ``done/<rank>/<n>`` (`Receiver.confirm`: JSON, its timings);
  `Sender.confirmed` is true once every receiver has, so a caller can stop waiting for anything slower (an HTTP
  answer) that carries the same news. The sender deletes each sync's keys during the next one.

The receiving side is `vlmreg.broadcast.receiver` (`Receiver`, re-exported here).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Self

import attrs
import torch
import torch.distributed as dist

from vlmreg.broadcast.buckets import BucketPacker, Layout, bucket_checksum
from vlmreg.broadcast.errors import BroadcastError, LayoutMismatchError, ReceiverGaveUp
from vlmreg.broadcast.group import (
    BACKENDS,
    KEY,
    TOKEN_ENV,
    broadcast,
    device_for,
    identity,
    join_group,
    scoped,
    shutdown_group,
    store_failed,
)
from vlmreg.broadcast.plan import WeightPlan
from vlmreg.broadcast.receiver import Receiver
from vlmreg.broadcast.tensor_stream import AHEAD_BYTES, TensorStream
from vlmreg.resolution import ResolvedFamily

__all__ = ["BACKENDS", "TOKEN_ENV", "Receiver", "Sender", "SyncStats"]


@attrs.frozen
class SyncStats:
    """What one `Sender.send` sent; ``ready_s``: how long it waited for every receiver to be ready, ``send_s``: the rest
    of the call (the tensors gathered and checked, packed, the broadcasts issued; on a GPU the transfer goes on after
    `Sender.send` returns)."""

    step: int
    kind: str
    bytes: int
    tensors: int
    buckets: int
    ready_s: float | None = None
    send_s: float | None = None


def poll_pause(waited_s: float) -> float:
    """How long to sleep between two polls of the store, after ``waited_s``: 0.1 ms for the first 20 ms (the wait is
    usually that short and on a sync's critical path), then longer, up to 10 ms."""
    return 0.0001 if waited_s < 0.02 else min(0.01, waited_s / 10)


class Sender:
    """Trainer side (rank 0): hosts the store, publishes the layouts once, and broadcasts each sync.

    The first `send` (or ``send(step, full=True)``) sends the full plan, frozen vision tower included; later
    ones send the per-step plan. On GPU, `send` returns without a host sync: packing and transfer are ordered on
    the current stream, so the optimizer may run next. After a `BroadcastError` the sender is unusable.
    """

    def __init__(
        self,
        resolved: ResolvedFamily,
        *,
        num_receivers: int,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: str = "gloo",
        device: torch.device | str | None = None,
        bucket_mb: int = 512,
        ring_depth: int = 2,
        gather_ahead_mb: int = AHEAD_BYTES // 2**20,
        timeout_s: float = 120.0,
        checksum: bool = False,
        token: str | None = None,
        lora_modules: frozenset[str] | None = None,
        lora_base: bool = True,
        lora_dtype: torch.dtype | None = None,
    ) -> None:
        """``lora_modules``, ``lora_base``, ``lora_dtype``: adapter syncs, these modules' LoRA sent as adapters
        (`WeightPlan.from_resolved`). ``ring_depth``: buckets packed ahead of the one on the wire (`BucketPacker`).
        ``gather_ahead_mb``: an FSDP2 trainer's sync, how far its gathers may run ahead of the packing
        (`vlmreg.broadcast.tensor_stream`)."""
        if num_receivers < 1:
            raise BroadcastError(f"num_receivers must be >= 1 (got {num_receivers})")
        self.backend, self.device = backend, device_for(backend, device)
        self.num_receivers, self.timeout_s, self.checksum = num_receivers, timeout_s, checksum
        self.ring_depth, self.gather_ahead_bytes = ring_depth, gather_ahead_mb * 2**20
        self._gather_stream: Any = None  # an FSDP2 trainer's gathers, on a GPU (`vlmreg.broadcast.tensor_stream`)
        self._timeout = timedelta(seconds=timeout_s)
        bucket_bytes = bucket_mb * 2**20
        self.plans = {
            kind: WeightPlan.from_resolved(
                resolved,
                include_frozen_vision=kind == "full",
                lora_modules=lora_modules,
                lora_base=lora_base,
                lora_dtype=lora_dtype,
            )
            for kind in ("full", "step")
        }
        self.layouts = [Layout.build(self.plans["full"].shapes(), bucket_bytes)]
        step_layout = Layout.build(self.plans["step"].shapes(), bucket_bytes)
        if step_layout != self.layouts[0]:
            self.layouts.append(step_layout)
        self._layout_of = {"full": 0, "step": len(self.layouts) - 1}
        self._signatures = [layout.signature() for layout in self.layouts]
        self.token = token or os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
        self._server: Any = dist.TCPStore(host, port, None, True, self._timeout, wait_for_workers=False)
        self._store: Any = scoped(self._server, self.token)
        self.host = host
        for index, layout in enumerate(self.layouts):
            self._store.set(f"{KEY}layout/{index}", layout.to_json())
        sender = {
            "world_size": num_receivers + 1,
            "backend": backend,
            "layouts": len(self.layouts),
            "checksum": checksum,
        }
        self._store.set(KEY + "sender", json.dumps({**sender, **identity()}))
        self._group: Any = None
        self._packers: dict[int, BucketPacker] = {}
        self._receivers: dict[int, dict[str, Any]] = {}
        self._syncs = 0
        self._broken: str | None = None
        # set by whoever launched the receivers' processes: raises when one has died (called while waiting for them)
        self.alive: Callable[[], None] | None = None

    @property
    def port(self) -> int:
        """The store's port (chosen by the OS when ``port=0``); receivers connect to ``host:port``."""
        return int(self._server.port)

    @property
    def process_group(self) -> Any:
        self.connect()
        return self._group

    def _describe(self, rank: int) -> str:
        info = self._receivers.get(rank)
        if info is None:
            return f"rank {rank} (never connected)"
        return f"rank {rank} (host {info['host']}, pid {info['pid']})"

    def connect(self, timeout_s: float | None = None) -> None:
        """Wait for every receiver to accept the layouts, then build the process group.

        ``timeout_s`` (default: the sender's) bounds the wait for every receiver's hello: engines may take long to load
        their model. Joining the group after that is bounded by the sender's ``timeout_s``; a receiver that said hello
        but never joins is a `BroadcastError` naming it and this sender's address, and the sender is unusable after.
        """
        if self._group is not None:
            return
        if self._broken is not None:
            raise ReceiverGaveUp(f"this sender is unusable ({self._broken}); create a new one")
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        pending = set(range(1, self.num_receivers + 1))
        while pending:
            for rank in sorted(pending):
                if self._store.check([f"{KEY}error/{rank}"]):
                    info = json.loads(self._store.get(f"{KEY}error/{rank}"))
                    if info.get("aborted"):
                        raise ReceiverGaveUp(self._aborted_message(rank, info, "while connecting"))
                    raise LayoutMismatchError(
                        f"receiver rank {rank} (host {info['host']}, pid {info['pid']}) rejected the weights: "
                        f"{info['error']}"
                    )
                if self._store.check([f"{KEY}hello/{rank}"]):
                    self._receivers[rank] = json.loads(self._store.get(f"{KEY}hello/{rank}"))
                    pending.discard(rank)
            if pending and time.monotonic() > deadline:
                missing = ", ".join(str(r) for r in sorted(pending))
                raise BroadcastError(
                    f"receiver rank(s) {missing} did not connect to {self.host}:{self.port} within {limit} s "
                    f"(a receiver needs this sender's token: the same {TOKEN_ENV}, or the token the trainer passes it)"
                )
            if pending:
                time.sleep(0.01)
        self._store.set(KEY + "connecting", "1")  # receivers build their side of the group only once this is set
        ranks = "; ".join(self._describe(r) for r in range(1, self.num_receivers + 1))

        def failed(reason: str) -> BroadcastError:
            self._broken = (
                f"the {self.backend} weight group at {self.host}:{self.port} was not joined within {self.timeout_s:g} "
                f"s: receiver(s) {ranks} said hello but did not all join the group (one died or stalled while joining) "
                f"({reason})"
            )
            return ReceiverGaveUp(self._broken)

        self._group = join_group(
            self.backend, self._store, 0, self.num_receivers + 1, self._timeout, self.device, failed
        )

    def _aborted_message(self, rank: int, info: dict[str, Any], when: str) -> str:
        return f"receiver rank {rank} (host {info['host']}, pid {info['pid']}) gave up {when}: {info['error']}"

    def _wait_ready(self, n: int, step: int) -> None:
        """Wait for every ``ready/<rank>/<n>``, polling ``error/<rank>`` too: a receiver that aborted fails this at
        once."""
        pending = set(range(1, self.num_receivers + 1))
        started = time.monotonic()
        deadline = started + self.timeout_s
        try:
            while True:
                for rank in sorted(pending):
                    if self._store.check([f"{KEY}ready/{rank}/{n}"]):
                        pending.discard(rank)
                    elif self._store.check([f"{KEY}error/{rank}"]):
                        info = json.loads(self._store.get(f"{KEY}error/{rank}"))
                        self._broken = self._aborted_message(rank, info, f"before sync {n} (step {step})")
                        raise BroadcastError(f"{self._broken}; no weights were sent")
                if not pending:
                    return
                if self.alive is not None:
                    try:
                        self.alive()  # a receiver's process that died before it was ready is named at once
                    except Exception as exc:
                        self._broken = f"a receiver died before sync {n} (step {step}): {exc}"
                        raise
                now = time.monotonic()
                if now > deadline:
                    break
                time.sleep(poll_pause(now - started))
        except store_failed() as exc:
            self._broken = f"the store failed while waiting for sync {n} (step {step}): {exc}"
            raise BroadcastError(self._broken) from exc
        named = "; ".join(self._describe(r) for r in sorted(pending)) or "unknown"
        self._broken = f"receiver {named} was not ready for sync {n} (step {step}) within {self.timeout_s} s"
        raise BroadcastError(f"{self._broken}: it is dead, stalled or still busy; no weights were sent")

    def _packer(self, layout_id: int) -> BucketPacker:
        if layout_id not in self._packers:
            self._packers = {layout_id: BucketPacker(self.layouts[layout_id], self.device, self.ring_depth)}
        return self._packers[layout_id]

    def send(self, step: int, *, full: bool = False) -> SyncStats:
        """Broadcast the current weights to every receiver (the full plan on the first sync or when ``full``)."""
        if self._broken is not None:
            raise BroadcastError(f"this sender is unusable ({self._broken}); create a new one")
        self.connect()
        entered = time.perf_counter()
        n = self._syncs + 1
        kind = "full" if full or n == 1 else "step"
        layout_id = self._layout_of[kind]
        layout, plan, signature = self.layouts[layout_id], self.plans[kind], self._signatures[layout_id]
        if plan.sharded:  # gathered bucket by bucket, as the packer reaches them (`vlmreg.broadcast.tensor_stream`)
            layout.check(plan.shapes(), signature)
            if self.device.type == "cuda" and self._gather_stream is None:
                self._gather_stream = torch.cuda.Stream(self.device)
            tensors = TensorStream(plan.tensors(), signature, self.gather_ahead_bytes, self._gather_stream)
        else:
            tensors = TensorStream.taken(layout.check(plan.tensors(), signature), signature)
        started = time.perf_counter()
        packer = self._packer(layout_id)
        works: list[Any] = []
        try:
            self._wait_ready(n, step)
            ready = time.perf_counter()
            self._store.set(f"{KEY}sync/{n}", json.dumps({"step": step, "layout": layout_id}))
            sums = []
            for k in range(len(layout.buckets)):
                if k >= packer.depth:
                    works[k - packer.depth].wait()
                buffer = packer.pack(k, tensors)
                tensors.release_before(packer.first_tensor(k + 1))
                if self.checksum:
                    sums.append(bucket_checksum(buffer))
                works.append(broadcast(self._group, buffer))
            if self.checksum:
                works.append(broadcast(self._group, torch.stack(sums)))
            self._forget(n)
            for work in works:
                work.wait()
        except store_failed() as exc:
            receivers = "; ".join(self._describe(r) for r in range(1, self.num_receivers + 1))
            self._broken = f"sync {n} (step {step}) failed during the transfer"
            raise BroadcastError(f"{self._broken} ({exc}); receivers: {receivers}") from exc
        finally:  # every gather issued, as on the other trainer ranks, even when the sync stopped early
            tensors.drain()
        self._syncs = n
        sent = time.perf_counter()
        return SyncStats(
            step,
            kind,
            layout.payload_bytes,
            len(layout.tensors),
            len(layout.buckets),
            ready_s=ready - started,
            send_s=sent - entered - (ready - started),
        )

    def _forget(self, n: int) -> None:
        """Delete the store keys of earlier syncs (done while the transfer runs)."""
        for rank in range(1, self.num_receivers + 1):
            self._store.delete_key(f"{KEY}ready/{rank}/{n}")
            if n > 1:
                self._store.delete_key(f"{KEY}done/{rank}/{n - 1}")
        if n > 1:
            self._store.delete_key(f"{KEY}sync/{n - 1}")

    def confirmed(self) -> bool:
        """Whether every receiver confirmed (`Receiver.confirm`) that it applied the last sync sent; one store query,
        never a wait. A receiver that does not confirm keeps it false: wait for its own answer as well."""
        if self._syncs == 0 or self._store is None:
            return False
        keys = [f"{KEY}done/{rank}/{self._syncs}" for rank in range(1, self.num_receivers + 1)]
        try:
            return bool(self._store.check(keys))
        except store_failed():
            return False

    def confirmations(self) -> list[dict[str, Any]]:
        """What each receiver posted with its confirmation of the last sync (``{}`` for one that did not confirm)."""
        records: list[dict[str, Any]] = []
        unreadable: tuple[type[BaseException], ...] = (*store_failed(), ValueError)
        for rank in range(1, self.num_receivers + 1):
            key = f"{KEY}done/{rank}/{self._syncs}"
            try:
                record = json.loads(self._store.get(key)) if self._store.check([key]) else {}
            except unreadable:
                record = {}
            records.append(record if isinstance(record, dict) else {})
        return records

    def close(self) -> None:
        """Tell waiting receivers the channel is closed (they raise `SenderClosed`) and release the group."""
        if self._store is None:
            return
        try:
            self._store.set(f"{KEY}sync/{self._syncs + 1}", json.dumps({"closed": True}))
        except store_failed():
            pass
        shutdown_group(self._group, self.backend)
        self._group = None
        self._store = None
        self._broken = self._broken or "it was closed"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
