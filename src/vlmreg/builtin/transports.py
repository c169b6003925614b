"""vlmreg's built-in weight transports, registered through ``vlmreg_register_transports`` like a third party's.

``gloo`` / ``nccl`` broadcast buckets over a private process group the server joins at start; ``filesystem`` writes an
atomic checkpoint directory per sync and names it in the request; ``ipc`` shares the trainer's GPU tensors by CUDA
IPC with vLLM workers on the same GPU. Each declares what it works with, and the config checks read only that.
Importing this module is cheap (torch loads when a sender or receiver is built), since it loads with the plugins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vlmreg.sdk.hookspecs import hookimpl
from vlmreg.sdk.transport import ReceiverContext, SenderContext, Transport, WorkerContext

__all__ = ["BUILTIN"]


def _group_sender(ctx: SenderContext) -> Any:
    # deferred: start-up cost (loads safetensors, torch)
    from vlmreg.broadcast.senders import GroupSender  # noqa: PLC0415

    return GroupSender(ctx)


def _group_receiver(backend: str) -> Callable[[ReceiverContext], Any]:
    def receiver(ctx: ReceiverContext) -> Any:
        # deferred: start-up cost (loads cattrs, concurrent, http, safetensors, torch, urllib.request)
        from vlmreg.serve.receivers import group_receiver  # noqa: PLC0415

        return group_receiver(ctx, backend)

    return receiver


def _directory_sender(ctx: SenderContext) -> Any:
    # deferred: start-up cost (loads safetensors, torch)
    from vlmreg.broadcast.senders import DirectorySender  # noqa: PLC0415

    return DirectorySender(ctx)


def _directory_receiver(ctx: ReceiverContext) -> Any:
    # deferred: start-up cost (loads cattrs, concurrent, http, safetensors, torch, urllib.request)
    from vlmreg.serve.receivers import directory_receiver  # noqa: PLC0415

    return directory_receiver(ctx)


def _group_worker(ctx: WorkerContext) -> Any:
    # deferred: start-up cost (loads safetensors, torch)
    from vlmreg.broadcast.worker_receivers import GroupWorkerReceiver  # noqa: PLC0415

    return GroupWorkerReceiver(ctx)


def _ipc_worker(ctx: WorkerContext) -> Any:
    # deferred: start-up cost (loads safetensors, torch)
    from vlmreg.broadcast.worker_receivers import IpcWorkerReceiver  # noqa: PLC0415

    return IpcWorkerReceiver(ctx)


def _ipc_sender(ctx: SenderContext) -> Any:
    # deferred: start-up cost (loads safetensors, torch)
    from vlmreg.broadcast.senders import IpcChannelSender  # noqa: PLC0415

    return IpcChannelSender(ctx)


BUILTIN = (
    Transport(
        name="gloo",
        sender=_group_sender,
        receiver=_group_receiver("gloo"),
        vllm_receiver=_group_worker,
        process_group=True,
        description="buckets broadcast over a private gloo process group (CPU tensors; any machine)",
    ),
    Transport(
        name="nccl",
        sender=_group_sender,
        receiver=_group_receiver("nccl"),
        vllm_receiver=_group_worker,
        gpu="separate",
        process_group=True,
        description="buckets broadcast over a private NCCL process group (one GPU per rank)",
    ),
    Transport(
        name="filesystem",
        sender=_directory_sender,
        receiver=_directory_receiver,
        description="an atomic checkpoint directory per sync, named in the request",
    ),
    Transport(
        name="ipc",
        sender=_ipc_sender,
        vllm_receiver=_ipc_worker,
        gpu="same",
        description="CUDA IPC handles of the trainer's tensors, for vLLM on the same GPU",
    ),
)


@hookimpl
def vlmreg_register_transports(register: Callable[[Transport], None]) -> None:
    """Register ``gloo``, ``nccl``, ``filesystem`` and ``ipc``."""
    for transport in BUILTIN:
        register(transport)
