"""The vLLM-worker ends of vlmreg's built-in transports, in the shape every ``vllm_receiver`` has.

A transport's ``vllm_receiver(context)`` (context: `vlmreg.sdk.transport.WorkerContext`) runs once in each vLLM worker
when the trainer joins it, and returns an object with:

- ``receive(*, step, timeout_s, **fields)``: take one sync and give its ``(checkpoint name, tensor)`` pairs (the
  worker hands them to vLLM's ``load_weights``, which keeps this worker's shard under tensor parallelism); ``fields``
  are what the trainer's sender passed to ``request``;
- ``close()``;
- optionally ``begin(*, step, timeout_s, **fields)``, an `vlmreg.broadcast.receiver.Incoming` whose buckets the worker
  waits for one by one, replaying its copy plan bucket by bucket behind the transfer
  (`vlmreg.broadcast.bucket_replay`), and ``confirm(record)``, which tells the trainer through the transport itself
  that the sync is applied (``record``: the worker's timings), before vLLM's answer makes its way back.

Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vlmreg.broadcast.ipc import IpcReceiver
from vlmreg.broadcast.receiver import Incoming, Receiver

__all__ = ["GroupWorkerReceiver", "IpcWorkerReceiver"]


class GroupWorkerReceiver:
    """``gloo`` / ``nccl``: the worker joins the trainer's private process group as rank ``first_rank + its global
    rank`` (``first_rank`` 1, or its server's first rank when the trainer syncs several servers)
    (``info``: the sender's host, port and token) and takes every bucket the trainer broadcasts."""

    def __init__(self, ctx: Any) -> None:
        info = ctx.info
        # several servers: this server's first rank in the group
        self.rank = int(info.get("first_rank", 1)) + int(ctx.rank)
        device = ctx.device if ctx.name == "nccl" else "cpu"
        self.receiver = Receiver(
            None,
            host=str(info["host"]),
            port=int(info["port"]),
            rank=self.rank,
            backend=ctx.name,
            device=device,
            timeout_s=float(ctx.timeout_s),
            token=info.get("token") or None,
        )

    def receive(self, *, step: int, timeout_s: float | None = None, **fields: Any) -> Iterable[tuple[str, Any]]:
        return list(self.receiver.receive(timeout_s=timeout_s).items())

    def begin(self, *, step: int, timeout_s: float | None = None, **fields: Any) -> Incoming:
        return self.receiver.begin(timeout_s=timeout_s)

    def confirm(self, record: dict[str, Any]) -> None:
        self.receiver.confirm(record)

    def close(self) -> None:
        self.receiver.close()


class IpcWorkerReceiver:
    """``ipc``: the worker maps the trainer's tensors from the sync's CUDA IPC message (JSON, never a pickle)."""

    def __init__(self, ctx: Any) -> None:
        self.ipc = IpcReceiver(ctx.device)

    def receive(
        self, *, step: int, timeout_s: float | None = None, ipc: Any = None, **fields: Any
    ) -> Iterable[tuple[str, Any]]:
        if ipc is None:
            raise ValueError(f"transport ipc: the update of step {step} carries no IPC message")
        return list(self.ipc.open(ipc))

    def close(self) -> None:
        self.ipc.close()
