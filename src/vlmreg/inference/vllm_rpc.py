"""Syncs that vLLM's workers take through ``/collective_rpc`` (`VlmregWorkerExtension.vlmreg_receive_weights`): with
``[broadcast] vllm_load = "direct"``, or a vLLM without the weight-transfer API.

A sync's critical path is the broadcast between the GPUs; around it, the request that tells each worker to receive
(HTTP to vLLM's API server, then its engine core and executor to every worker) and the answer coming back the same way
took 6-8 ms of a 17-20 ms NCCL sync (4 x H200, 2026-11-26). So:

- **posted early**: in the synchronous loop (``max_off_policy_steps = 0``) the trainer makes the request as soon as
  the step's rollouts are collected (`RpcSyncs.post_early`), so it reaches the workers while the trainer updates;
  they wait in their receive (with no time limit: the trainer's `Sender.close`, or its store going away with it,
  ends the wait) and the sync starts as soon as the update is done. Only where ``[broadcast] vllm_early_receive``
  allows (``"launched"``, the default: a server the trainer launched, which no one else uses), with a transport whose
  sender takes no per-sync fields (``early_receive``: the process groups) and no LoRA adapter syncs;
- **not waited for**: once the trainer's own broadcast is done, every worker is inside the RPC (it took part in the
  broadcast), so vLLM runs no forward pass and serves no later request until its workers have written the weights:
  the trainer returns then. Waiting for the workers' confirmation (each posts ``done`` to the weight group's store
  once its weights are written, `vlmreg.broadcast.receiver.Receiver.confirm`) cost 2.4-4.2 ms of a 12-13 ms sync
  (4 x H200), the last bucket's copies and the store's round trip, which now overlap the trainer's next requests.
  The trainer does wait until its broadcast has left its GPU (the stream its buckets were broadcast on
  synchronized: ``sync_ack_s``), so ``sync_s`` counts the transfer, as the raw broadcast it is measured against does.
  vLLM's answer is taken (`RpcSyncs.settle`) before anything uses what the server produced with those weights: in
  the synchronous loop when the next rollouts are collected (`post_early`), with rollouts collected ahead before the
  next update (`vlmreg.train.recipe.Trainer.update`), and at the next sync; a worker's error is raised
  there, so no update trains on rollouts of a sync that failed. The workers' own timings of that sync come with the
  next step's metrics (``sync_prev_worker_*``). Adapter syncs still wait for the answer (vLLM takes them next).

Safety is what it was: the workers copy into the weights inside the RPC, which vLLM's engine loop runs between its
steps, so no forward pass runs meanwhile, and a request made after the sync (with the next cache scope) is served
only once the RPC has returned. A request posted early is made only while no rollout is in flight (the collection is
over and nothing else uses the server before the sync), and vLLM takes no request until the sync is done: so only for
servers whose only client is this trainer.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from vlmreg.inference.calls import ServerCall, on_every_server, transfer_alongside
from vlmreg.sdk.errors import VlmregError

__all__ = ["EARLY_HTTP_TIMEOUT_S", "RpcSyncs", "worker_timings"]

#: The HTTP time limit of a request posted early (it stays open through the trainer's update); no wait of the trainer is
#: this long: the sync's own waits are bounded by ``[broadcast] timeout_s``.
EARLY_HTTP_TIMEOUT_S = 24 * 3600.0


def worker_timings(sender: Any, prefix: str) -> dict[str, float]:
    """The slowest worker's ``wait_s``, ``receive_s``, ``copy_s`` and ``tail_s`` of the sender's last sync, from what
    each posted with its confirmation (`Sender.confirmations`), named ``prefix + name``; none a sender lacks."""
    records: list[dict[str, Any]] = getattr(sender, "confirmations", lambda: [])()
    timings = {}
    for name in ("wait_s", "receive_s", "copy_s", "tail_s"):
        values = [float(r[name]) for r in records if isinstance(r.get(name), (int, float))]
        if values:
            timings[prefix + name] = max(values)
    return timings


class RpcSyncs:
    """The ``/collective_rpc`` syncs of one `vlmreg.inference.vllm_server.VllmServer` (``server``: its ``urls``,
    ``_rpc``, ``check_alive`` and ``timeout_s``); ``early``: whether requests may be posted early."""

    def __init__(self, server: Any, *, early: bool) -> None:
        self.server, self.early = server, early
        self.posted: tuple[int, ServerCall] | None = None  # a request posted early, for the next sync
        self.pending: tuple[ServerCall, str] | None = None  # the last sync's request, sent but not yet answered
        self.timings: dict[str, float] = {}
        self.settled: dict[str, float] = {}  # the settled sync's worker timings and the settle's own wait

    @property
    def where(self) -> str:
        return ", ".join(self.server.urls)

    def _call(self, update: dict[str, Any], timeout_s: float | None = None) -> ServerCall:
        server = self.server

        def ask() -> Any:
            return on_every_server(
                server.urls,
                lambda index, url: server._rpc(url, "vlmreg_receive_weights", [json.dumps(update)], timeout_s),
            )

        return ServerCall(ask)

    def settle(self) -> None:
        """Take the answer of the last sync, which returned once its broadcast was sent (normally long there by now);
        raise its error. Keeps the workers' timings of that sync and the wait in ``settled``."""
        if self.pending is None:
            return
        call, what = self.pending
        self.pending = None
        started = time.perf_counter()
        if not call.wait(self.server.timeout_s + 60):
            raise VlmregError(
                f"the rollout server at {self.where} took part in the broadcast to {what}, but its answer did not "
                f"come within broadcast.timeout_s + 60 s"
            )
        if call.error is not None:
            self.server.check_alive()
            raise VlmregError(f"the rollout server at {self.where} failed after taking the weights: {call.error}")
        self.settled = {"sync_prev_settle_s": time.perf_counter() - started}
        self.settled.update(worker_timings(self.server.sender, "sync_prev_worker_"))

    def post_early(self, step: int) -> bool:
        """Ask every worker now to receive the next sync (of ``step``), if allowed; whether it was asked."""
        if not self.early or self.posted is not None:
            return False
        self.settle()
        self.server.check_alive()
        self.posted = (step, self._call({"step": step, "timeout_s": None, "fields": {}}, EARLY_HTTP_TIMEOUT_S))
        return True

    def send(self, update: dict[str, Any], transfer: Any, confirmed: Any, what: str) -> None:
        """One sync: the workers' request (the one posted early, else a new one) and the sender's ``transfer``
        alongside; with ``confirmed`` (the sender's workers confirm through the transport: not adapter syncs) it
        returns once the transfer is done, the answer left to `settle`; otherwise once the servers answered."""
        self.settle()
        call, early = None, False
        if self.posted is not None:
            call, early, self.posted = self.posted[1], True, None
            if update.get("fields"):
                raise VlmregError(
                    f"internal: a sync with fields {sorted(update['fields'])} after a request posted early"
                )
            if call.done():  # the workers returned before any sync was sent: their error, not a broadcast into no one
                self.server.check_alive()
                call.result(0, what=what, url=self.where)
                raise VlmregError(f"the rollout server at {self.where} answered before the weights were sent")
        if call is None:
            call = self._call(update)
        marks: dict[str, float] = {}

        def timed() -> None:
            transfer()
            marks["sent"] = time.perf_counter()

        pending = transfer_alongside(
            call,
            timed,
            what=what,
            url=self.where,
            timeout_s=self.server.timeout_s,
            check_alive=self.server.check_alive,
            confirmed=None if confirmed is None else (lambda: True),  # in the RPC: nothing is served before it is done
        )
        if pending and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # the sync's own cost: until the broadcast left this GPU
        self.timings = {"sync_ack_s": time.perf_counter() - marks["sent"], "sync_early": float(early)}
        if pending:
            self.pending = (call, what)

    def close(self) -> None:
        """Forget requests in flight (the sender's close ends the workers' waits; vLLM goes or stays as it is)."""
        self.posted = self.pending = None
