"""The trainer's ends of vlmreg's built-in transports, in the shape every registered transport's sender has.

A sender (what ``Transport.sender(context)`` returns) has four methods; the trainer's `ServerLink` calls nothing else:

- ``server_args() -> (argv, env)``: the ``vlmreg serve`` arguments (and environment variables, for secrets) a
  launched server needs to take this sender's syncs;
- ``connect(timeout_s, *, launched)``: wait until the server can take syncs (joined the group, say), or fail;
- ``send(step, *, full, request) -> SyncStats | None``: send the weights of ``step`` (``full``: the frozen vision
  tower too); ``request(fields, transfer=None, confirmed=None)`` posts ``{"step": step, **fields}`` to the server's
  ``/v1/weights`` and returns once the server has applied them, running ``transfer()`` meanwhile when given (a
  collective both sides take part in); ``confirmed()``, when given, is true once every receiver has said through the
  transport itself that it applied them (the request may then return without waiting for the server's answer);
- ``close()``;
- for a transport with a ``vllm_receiver``, also ``worker_info() -> dict``: what each vLLM worker needs to join (JSON,
  sent once through vLLM's ``/init_weight_transfer_engine``; the workers' end gets it as ``WorkerContext.info``);
- optionally ``alive``, an attribute the trainer sets to a callable that raises once a server it launched has
  exited: a sender that waits for its receivers (for them to be ready, say) calls it while it waits, so a server that
  died is named at once instead of after ``timeout_s``;
- optionally ``early_receive = True``: its requests carry no fields, so the trainer may ask vLLM's workers to start
  receiving before the sync (`vlmreg.inference.vllm_rpc`); and ``confirmations() -> list[dict]``: what each receiver
  posted with its confirmation of the last sync (its timings).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmreg.broadcast.errors import BroadcastError
from vlmreg.broadcast.filesystem import FilesystemSender
from vlmreg.broadcast.ipc import IpcSender
from vlmreg.broadcast.transport import TOKEN_ENV, Sender, SyncStats
from vlmreg.sdk.errors import VlmregError

__all__ = ["DirectorySender", "GroupSender", "IpcChannelSender"]


class GroupSender:
    """``gloo`` / ``nccl``: buckets broadcast over a private process group the server joined at start; receivers that
    confirm (`vlmreg.broadcast.receiver.Receiver.confirm`) end a sync's wait before the server's answer."""

    early_receive = True  # a request carries no fields: the receivers may be told to receive before the sync

    def __init__(self, ctx: Any) -> None:
        broadcast = ctx.broadcast
        self.name, self.url, self.log, self.timeout_s = ctx.name, ctx.url, ctx.log, broadcast.timeout_s
        self.sender = Sender(
            ctx.resolved,
            num_receivers=ctx.num_receivers,
            host=broadcast.host,
            port=broadcast.port,
            backend=ctx.name,
            device=ctx.device,
            bucket_mb=broadcast.bucket_mb,
            timeout_s=broadcast.timeout_s,
            checksum=broadcast.checksum,
            lora_modules=ctx.lora_modules,
            lora_base=ctx.lora_base,
            lora_dtype=ctx.lora_dtype,
        )

    @property
    def alive(self) -> Callable[[], None] | None:
        """The launched servers' check, called by `Sender` while it waits for the receivers to be ready for a sync."""
        return self.sender.alive

    @alive.setter
    def alive(self, check: Callable[[], None] | None) -> None:
        self.sender.alive = check

    @property
    def host(self) -> str:
        return self.sender.host

    @property
    def port(self) -> int:
        return self.sender.port

    @property
    def token(self) -> str:
        return self.sender.token

    def server_args(self) -> tuple[list[str], dict[str, str]]:
        argv = [
            "--weights-from",
            f"{self.sender.host}:{self.sender.port}",
            "--weights-backend",
            self.name,
            "--weights-timeout",
            str(self.timeout_s),
        ]
        return argv, {TOKEN_ENV: self.sender.token}  # the group's store needs the token: in the environment, not on ps

    def worker_info(self) -> dict[str, Any]:
        return {"host": self.sender.host, "port": self.sender.port, "token": self.sender.token}

    def connect(self, timeout_s: float, *, launched: bool) -> None:
        if not launched:
            if not os.environ.get(TOKEN_ENV):
                raise VlmregError(
                    "a server started apart joins the weight group only with its token: set the same secret in "
                    f"{TOKEN_ENV} for the trainer and for `vlmreg serve --weights-from` (or let the trainer launch the "
                    "server: launch = true)"
                )
            self.log(
                f"waiting for the server at {self.url} to join the weight group at "
                f"{self.sender.host}:{self.sender.port}"
            )
        self.sender.connect(timeout_s=timeout_s)

    def send(self, step: int, *, full: bool, request: Any) -> SyncStats:
        sent: list[SyncStats] = []
        request({}, transfer=lambda: sent.append(self.sender.send(step, full=full)), confirmed=self.sender.confirmed)
        return sent[0]

    def confirmations(self) -> list[dict[str, Any]]:
        return self.sender.confirmations()

    def close(self) -> None:
        self.sender.close()


class DirectorySender:
    """``filesystem``: an atomic checkpoint directory per sync (`FilesystemSender`), named in the request."""

    def __init__(self, ctx: Any) -> None:
        directory = Path(ctx.broadcast.directory) if ctx.broadcast.directory else ctx.output_dir / "weights"
        self.writers = {
            kind: FilesystemSender(
                directory, ctx.resolved, include_frozen_vision=kind == "full", lora_modules=ctx.lora_modules
            )
            for kind in ("full", "step")
        }
        self.directory = directory

    def server_args(self) -> tuple[list[str], dict[str, str]]:
        return ["--weights-dir", str(self.directory)], {}  # the server takes directories only under this one

    def connect(self, timeout_s: float, *, launched: bool) -> None:
        """Nothing to join: each sync names its directory."""

    def send(self, step: int, *, full: bool, request: Any) -> SyncStats:
        writer = self.writers["full" if full else "step"]
        path = writer.write(step, replace=full)  # a run's first sync may rewrite its step
        request({"path": str(path)})
        return SyncStats(step, "full" if full else "step", writer.written_bytes, len(writer.plan), 0)

    def close(self) -> None:
        """Nothing to release: the directories stay (the newest two)."""


class IpcChannelSender:
    """``ipc``: the trainer's tensors shared by CUDA IPC with a server on the same GPU (vLLM's workers map them)."""

    def __init__(self, ctx: Any) -> None:
        self.ipc = IpcSender(
            ctx.resolved, ctx.device, lora_modules=ctx.lora_modules, lora_base=ctx.lora_base, lora_dtype=ctx.lora_dtype
        )

    def server_args(self) -> tuple[list[str], dict[str, str]]:
        raise BroadcastError('transport "ipc" has no vlmreg serve end: it is for rollout.server = "vllm"')

    def worker_info(self) -> dict[str, Any]:
        return {}  # each sync's message carries its handles

    def connect(self, timeout_s: float, *, launched: bool) -> None:
        """Nothing to join: each sync carries its IPC handles."""

    def send(self, step: int, *, full: bool, request: Any) -> SyncStats:
        message = self.ipc.share(step, full=full)
        try:
            request({"ipc": message})
        finally:
            self.ipc.release()
        return SyncStats(step, message["kind"], message["bytes"], message["count"], 0)

    def close(self) -> None:
        self.ipc.release()
