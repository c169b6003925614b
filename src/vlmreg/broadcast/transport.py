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
  receiver fails locally, and the sender raises at once with its reason.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from datetime import timedelta
from typing import Any, Self

import attrs
import torch
import torch.distributed as dist

from vlmreg.broadcast.buckets import BucketPacker, Layout, bucket_checksum, dtype_name
from vlmreg.broadcast.errors import BroadcastError, LayoutMismatchError, ReceiverGaveUp, SenderClosed
from vlmreg.broadcast.group import (
    BACKENDS,
    FOREVER,
    KEY,
    TOKEN_ENV,
    broadcast,
    device_for,
    identity,
    join_group,
    join_store,
    scoped,
    shutdown_group,
    store_failed,
)
from vlmreg.broadcast.plan import WeightPlan, receiving_plan
from vlmreg.resolution import ResolvedFamily

__all__ = ["BACKENDS", "TOKEN_ENV", "Receiver", "Sender", "SyncStats"]


@attrs.frozen
class SyncStats:
    """What one `Sender.send` sent."""

    step: int
    kind: str
    bytes: int
    tensors: int
    buckets: int


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
        timeout_s: float = 120.0,
        checksum: bool = False,
        token: str | None = None,
        lora_modules: frozenset[str] | None = None,
        lora_base: bool = True,
        lora_dtype: torch.dtype | None = None,
    ) -> None:
        """``lora_modules``, ``lora_base``, ``lora_dtype``: adapter syncs, these modules' LoRA sent as adapters
        (`WeightPlan.from_resolved`)."""
        if num_receivers < 1:
            raise BroadcastError(f"num_receivers must be >= 1 (got {num_receivers})")
        self.backend, self.device = backend, device_for(backend, device)
        self.num_receivers, self.timeout_s, self.checksum = num_receivers, timeout_s, checksum
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
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0005
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
                if time.monotonic() > deadline:
                    break
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
        except store_failed() as exc:
            self._broken = f"the store failed while waiting for sync {n} (step {step}): {exc}"
            raise BroadcastError(self._broken) from exc
        named = "; ".join(self._describe(r) for r in sorted(pending)) or "unknown"
        self._broken = f"receiver {named} was not ready for sync {n} (step {step}) within {self.timeout_s} s"
        raise BroadcastError(f"{self._broken}: it is dead, stalled or still busy; no weights were sent")

    def _packer(self, layout_id: int) -> BucketPacker:
        if layout_id not in self._packers:
            self._packers = {layout_id: BucketPacker(self.layouts[layout_id], self.device)}
        return self._packers[layout_id]

    def send(self, step: int, *, full: bool = False) -> SyncStats:
        """Broadcast the current weights to every receiver (the full plan on the first sync or when ``full``)."""
        if self._broken is not None:
            raise BroadcastError(f"this sender is unusable ({self._broken}); create a new one")
        self.connect()
        n = self._syncs + 1
        kind = "full" if full or n == 1 else "step"
        layout_id = self._layout_of[kind]
        layout = self.layouts[layout_id]
        tensors = layout.check(self.plans[kind].tensors(), self._signatures[layout_id])
        self._wait_ready(n, step)
        self._store.set(f"{KEY}sync/{n}", json.dumps({"step": step, "layout": layout_id}))
        packer = self._packer(layout_id)
        works: list[Any] = []
        try:
            sums = []
            for k in range(len(layout.buckets)):
                if k >= packer.depth:
                    works[k - packer.depth].wait()
                buffer = packer.pack(k, tensors)
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
        self._syncs = n
        return SyncStats(step, kind, layout.payload_bytes, len(layout.tensors), len(layout.buckets))

    def _forget(self, n: int) -> None:
        """Delete the store keys of earlier syncs (done while the transfer runs)."""
        for rank in range(1, self.num_receivers + 1):
            self._store.delete_key(f"{KEY}ready/{rank}/{n}")
        if n > 1:
            self._store.delete_key(f"{KEY}sync/{n - 1}")

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

    def receive(self, timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """Post "ready", wait (``timeout_s``; ``None``: no limit) for the next sync and receive it.

        Returns checkpoint name -> tensor. Raises `SenderClosed` when the sender closed the channel, and
        `BroadcastError` when a transfer fails or a checksum differs (the tensors are then not handed over).
        """
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
        layout = self.layouts[header["layout"]]
        buckets, views = self._buffers(header["layout"])
        works = [broadcast(self._group, bucket) for bucket in buckets]
        sums = torch.empty(len(buckets), dtype=torch.int64, device=self.device) if self.checksum else None
        if sums is not None:
            works.append(broadcast(self._group, sums))
        local = []
        try:
            for bucket, work in zip(buckets, works, strict=False):
                work.wait()
                if sums is not None:  # on GPU this overlaps the transfer of the next buckets
                    local.append(bucket_checksum(bucket))
            works[-1].wait()
        except store_failed() as exc:
            raise BroadcastError(f"receiver rank {self.rank}: sync {n} failed during the transfer ({exc})") from exc
        self._syncs = n
        if sums is not None:
            bad = (torch.stack(local) != sums).nonzero().flatten().tolist()
            if bad:
                names = layout.names_in_bucket(bad[0])
                raise BroadcastError(
                    f"receiver rank {self.rank}: checksum mismatch in bucket {bad[0]} of sync {n} "
                    f"({len(bad)} bad bucket(s); first holds {', '.join(names[:3])}); the weights were not handed over"
                )
        self.last_step = header["step"]
        return dict(views)

    def close(self) -> None:
        shutdown_group(self._group, self.backend)
        self._group = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None and not isinstance(exc, SenderClosed):
            self.abort(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        self.close()
