"""Same-GPU weight sync by CUDA IPC: the engine reads the trainer's tensors in place, with no copy through the CPU.

When the trainer and an inference engine share one GPU, NCCL cannot join them (it needs one rank per device),
and a gloo sync copies every byte through host memory. CUDA IPC lets the engine's process map the trainer's
allocations directly: the trainer describes each tensor of a sync (`IpcSender.share`), and the engine rebuilds
views of the same device memory (`IpcReceiver.open`) and copies them into its own weights, one device-to-device
copy per tensor.

The description is plain JSON, not a pickle: per tensor its checkpoint name, shape, stride, dtype and the CUDA IPC
handles torch's own ``reduce_tensor`` produces (base64). The receiver only ever rebuilds ``torch.Tensor`` views
of a CUDA allocation from it, so a message cannot make it run code. Ordering: the sender waits for its stream
before the message leaves (torch's IPC event is waited on only when an allocation is first opened, and later syncs
reuse the opened allocation), so the receiver never reads a weight the optimizer is still writing. The receiver keeps
the allocations it opened during the last sync mapped (parameters keep their storage from step to step, so later syncs
open
nothing), and lets go of the rest, so temporaries (merged LoRA weights) do not pile up in the trainer's memory.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from vlmreg.broadcast.buckets import dtype_name
from vlmreg.broadcast.errors import BroadcastError
from vlmreg.broadcast.plan import WeightPlan
from vlmreg.resolution import ResolvedFamily

__all__ = ["IPC_VERSION", "IpcReceiver", "IpcSender", "gpu_uuid"]

IPC_VERSION = 1


def gpu_uuid(device: torch.device | int | None = None) -> str:
    """The physical GPU's UUID (the same string in every process, whatever ``CUDA_VISIBLE_DEVICES`` says)."""
    index = device.index if isinstance(device, torch.device) else device
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid)


def _layout(names: list[str], tensors: list[torch.Tensor]) -> tuple:
    """Where each tensor of a sync lives: equal layouts mean the receiver's views of the last one are still right."""
    return tuple(
        (n, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        for n, t in zip(names, tensors, strict=True)
    )


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode("ascii")


def _unb64(text: str | None, what: str) -> bytes | None:
    if text is None:
        return None
    if not isinstance(text, str):
        raise BroadcastError(f"IPC message: {what} must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise BroadcastError(f"IPC message: {what} is not valid base64") from None


def open_tensor(entry: dict[str, Any], index: int, *, what: str = "tensor") -> tuple[torch.Tensor, tuple[bytes, int]]:
    """The tensor a `describe` entry shares (mapped from the other process; its allocation stays mapped while the
    tensor lives), and the key of that allocation."""

    try:
        dtype = getattr(torch, entry["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise KeyError("dtype")
        handle = _unb64(entry["handle"], f"{what}: handle")
        key = (handle or b"", int(entry["storage_offset"]))
        tensor = rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(entry["size"]),
            tuple(entry["stride"]),
            int(entry["offset"]),
            torch.storage.TypedStorage,
            dtype,
            index,
            handle,
            int(entry["storage_bytes"]),
            int(entry["storage_offset"]),
            False,
            _unb64(entry["ref_counter"], f"{what}: ref_counter"),
            int(entry["ref_offset"]),
            _unb64(entry["event"], f"{what}: event"),
            bool(entry["event_sync"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BroadcastError(f"IPC message: tensor {what} is malformed ({exc})") from None
    return tensor, key


def describe(tensor: torch.Tensor) -> dict[str, Any]:
    """One CUDA tensor as JSON: what `torch.multiprocessing.reductions.reduce_tensor` shares, with no Python objects."""

    if tensor.device.type != "cuda":
        raise BroadcastError(f"CUDA IPC shares CUDA tensors only, not one on {tensor.device}")
    _, args = reduce_tensor(tensor.detach())
    (
        _cls,
        size,
        stride,
        offset,
        _storage_cls,
        dtype,
        device,
        handle,
        storage_bytes,
        storage_offset,
        _grad,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = args
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": int(offset),
        "dtype": dtype_name(dtype),
        "device": int(device),
        "handle": _b64(handle),
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "ref_counter": _b64(ref_handle),
        "ref_offset": int(ref_offset),
        "event": _b64(event_handle),
        "event_sync": bool(event_sync),
    }


class IpcSender:
    """Trainer side: describes the current weights of a sync for a receiver on the same GPU.

    The tensors shared by `share` must stay alive and unchanged until the receiver has loaded them: keep the
    sender's `hold` until the engine confirms, then call `release`.
    """

    def __init__(
        self,
        resolved: ResolvedFamily,
        device: torch.device | str,
        lora_modules: frozenset[str] | None = None,
        lora_base: bool = True,
        lora_dtype: torch.dtype | None = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise BroadcastError(f'transport "ipc" shares GPU memory: the trainer runs on {self.device}, not a GPU')
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
        self.uuid = gpu_uuid(self.device)
        self.hold: list[torch.Tensor] = []
        self.syncs = 0
        self.described: tuple[str, tuple] | None = None  # (id, layout) of the last sync sent with its tensors

    def share(self, step: int, *, full: bool = False) -> dict[str, Any]:
        """The JSON message for one sync (the full plan on the first sync or when ``full``); keeps the tensors held.

        When every tensor is where it was in the last described sync (the parameters themselves, step after step),
        the message only names that sync (``"reuse"``) and the receiver takes the views it already opened."""
        kind = "full" if full or self.syncs == 0 else "step"
        names, self.hold = self._gather(kind)
        torch.cuda.current_stream(self.device).synchronize()  # nothing the optimizer still writes is read
        self.syncs += 1
        payload = sum(t.numel() * t.element_size() for t in self.hold)
        message = {
            "version": IPC_VERSION,
            "step": step,
            "kind": kind,
            "gpu": self.uuid,
            "bytes": payload,
            "count": len(self.hold),
        }
        layout = _layout(names, self.hold)
        if self.described is not None and layout == self.described[1]:
            return {**message, "reuse": self.described[0]}
        sync_id = secrets.token_hex(8)
        self.described = (sync_id, layout)
        tensors = [{"name": name, **describe(tensor)} for name, tensor in zip(names, self.hold, strict=True)]
        return {**message, "id": sync_id, "tensors": tensors}

    def unchanged(self) -> str | None:
        """The id of the last described sync when a step sync made now would share exactly its tensors (the same
        memory), else ``None``; shares nothing and waits for nothing (what a pushed plan checks)."""
        if self.described is None:
            return None
        return self.described[0] if _layout(*self._gather("step")) == self.described[1] else None

    def _gather(self, kind: str) -> tuple[list[str], list[torch.Tensor]]:
        """The names and tensors of a sync of ``kind`` on the sender's GPU (the parameters themselves where they
        are)."""
        names, tensors = [], []
        for name, tensor in self.plans[kind].tensors():
            tensor = tensor.detach()
            if tensor.device != self.device:  # "cuda" names the same GPU as "cuda:0": no copy then
                tensor = tensor.to(self.device)
            names.append(name)
            tensors.append(tensor)
        return names, tensors

    def release(self) -> None:
        """Drop the tensors of the last sync and let torch free what the receiver has let go of."""
        self.hold = []
        torch.cuda.ipc_collect()


class IpcReceiver:
    """Engine side: rebuilds the trainer's tensors from a message, on the same physical GPU."""

    def __init__(self, device: torch.device | int | None = None) -> None:
        index = device.index if isinstance(device, torch.device) else device
        self.index: int = torch.cuda.current_device() if index is None else index
        self.uuid = gpu_uuid(self.index)
        self._open: dict[tuple[bytes, int], torch.Tensor] = {}
        self._sync_id: str | None = None  # the last sync whose tensors were opened, and its (name, view) pairs
        self._pairs: list[tuple[str, torch.Tensor]] = []

    def open(self, message: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) pairs of one sync, views of the trainer's memory: copy them before returning."""
        if not isinstance(message, dict) or message.get("version") != IPC_VERSION:
            raise BroadcastError(
                f"IPC message: expected version {IPC_VERSION}, got "
                f"{message.get('version') if isinstance(message, dict) else message!r}"
            )
        if message.get("gpu") != self.uuid:
            raise BroadcastError(
                f"IPC message: the trainer's tensors are on GPU {message.get('gpu')}, this engine runs on {self.uuid}; "
                'transport "ipc" needs both on one GPU (use "nccl" across GPUs)'
            )
        reuse = message.get("reuse")
        if reuse is not None:
            if reuse != self._sync_id:
                raise BroadcastError(
                    f"IPC message: step {message.get('step')} reuses the tensors of sync {reuse!r}, but this receiver "
                    f"last opened {self._sync_id!r} (restarted since?)"
                )
            yield from self._pairs
            return
        used: dict[tuple[bytes, int], torch.Tensor] = {}
        pairs: list[tuple[str, torch.Tensor]] = []
        for entry in message.get("tensors", []):
            name = entry.get("name")
            tensor, key = open_tensor(entry, self.index, what=repr(name))
            used[key] = tensor
            pairs.append((name, tensor))
            yield name, tensor
        self._open = used  # keep what this sync used mapped; let the rest go
        self._sync_id, self._pairs = message.get("id"), pairs

    def close(self) -> None:
        self._open, self._sync_id, self._pairs = {}, None, []
