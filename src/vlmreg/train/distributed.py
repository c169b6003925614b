"""Several processes (``torchrun``): FSDP2 sharding read from the resolved family, and the collectives the
recipe needs. One process (no ``WORLD_SIZE``) gets ``None`` everywhere and pays nothing.

``fully_shard`` goes on each decoder layer (``resolved.layers``), each vision block (``resolved.vision_blocks``)
and the model. Every rank plays its own share of the step's prompts; for generation the parameters are
gathered once (`unsharded`) so ranks can sample different lengths without matching collectives. Losses are
normalised by global token (or sequence) counts and ranks run the same number of micro-batches, so the
gradient equals the one a single process would compute on the whole batch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import torch
import torch.distributed as dist

from vlmreg.resolution import ResolvedFamily

__all__ = [
    "Distributed",
    "LocalShard",
    "from_environment",
    "full_tensor",
    "load_into",
    "raise_on_every_rank",
    "release_process_group",
    "shard_model",
    "unsharded",
]


@attrs.frozen
class Distributed:
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(tensor)
        return tensor.tolist()

    def max(self, value: int) -> int:
        return int(self.max_float(float(value)))

    def max_float(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor.item())

    def max_many(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def gather_objects(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out


def raise_on_every_rank(ctx: Distributed | None, error: Exception | None, kind: type[Exception]) -> None:
    """Raise ``error`` where it happened, and on every other rank of ``ctx`` the first rank's error message as a
    ``kind``: one rank's failure (a full disk on rank 0) ends the run on all of them. Also a barrier."""
    if ctx is not None:
        message = next((m for m in ctx.gather_objects(str(error) if error else None) if m), None)
        if message is not None and error is None:
            raise kind(message)
    if error is not None:
        raise error


def from_environment(device_setting: str) -> Distributed | None:
    """Join the process group ``torchrun`` describes, or ``None`` for one process.

    On GPUs the group has two backends: NCCL for tensors on the GPU (FSDP2's collectives) and gloo for everything on
    the CPU, which includes the ranks' small messages (`Distributed.gather_objects`: errors, RNG states, server
    addresses). Those never go through a CUDA stream, so they still reach the other ranks when the GPU is stuck: a
    vLLM worker that failed before receiving a sync leaves the trainer's broadcast pending on its stream, and a
    message copied to the GPU behind it waited for ever (the first MoE run beside vLLM hung so)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_setting == "cuda" or (device_setting == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    return Distributed(rank=dist.get_rank(), world=dist.get_world_size(), device=device)


def shard_model(resolved: ResolvedFamily, ctx: Distributed, prefetch: int = 0) -> None:
    """``fully_shard`` per decoder layer and vision block (from the resolved family), then the whole model.

    ``prefetch`` > 0: each decoder layer's forward starts gathering the next ``prefetch`` layers' weights, and its
    backward the previous ``prefetch`` layers' (FSDP2's explicit prefetching); 0 leaves FSDP2's own (the next layer's
    gather is issued when the host reaches it in forward, one layer ahead in backward)."""
    # deferred: start-up cost (loads torch.distributed.device_mesh)
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    # deferred: start-up cost (loads torch.distributed.fsdp)
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    if prefetch < 0:
        raise ValueError(f"prefetch must be 0 or more layers, got {prefetch}")
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    layers = list(resolved.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    for block in resolved.vision_blocks or ():
        fully_shard(block, mesh=mesh)
    fully_shard(resolved.model, mesh=mesh)
    if prefetch:
        for i, layer in enumerate(layers):
            ahead = layers[i + 1 : i + 1 + prefetch]
            behind = layers[max(0, i - prefetch) : i][::-1]  # nearest first: the order backward reaches them
            if ahead:
                layer.set_modules_to_forward_prefetch(ahead)  # type: ignore[operator]
            if behind:
                layer.set_modules_to_backward_prefetch(behind)  # type: ignore[operator]


def initialize_from_root(model: torch.nn.Module, token_id: int, device: torch.device) -> None:
    """Run one tiny forward through the root, so FSDP initialises from it, then reshard everything.

    FSDP keeps the root's parameters gathered after a forward; until they are resharded, ``model.parameters()``
    would hand the optimizer (or a weight plan) the transient gathered tensors instead of the shards.
    """
    # deferred: start-up cost (loads torch.distributed.fsdp)
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    with torch.no_grad():
        model(input_ids=torch.tensor([[token_id]], device=device), use_cache=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextmanager
def unsharded(model: torch.nn.Module, ctx: Distributed | None) -> Iterator[None]:
    """Full parameters on every rank for the duration (generation), resharded after."""
    if ctx is None:
        yield
        return
    # deferred: start-up cost (loads torch.distributed.fsdp)
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    root = modules[0]  # modules() walks outside-in: the first FSDP module is the root
    for m in modules:
        m.unshard()
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            # FSDP keeps the root unsharded after forward (backward needs it at once); the trainer relies on that
            # to apply the lm_head outside the forward, so restore exactly that setting.
            m.set_reshard_after_forward(m is not root, recurse=False)
            m.reshard()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter or state, on the CPU (a collective for DTensors)."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().contiguous().cpu()


class LocalShard(torch.Tensor):
    """This rank's part of a sharded tensor, as ``DTensor.to_local()`` gave it (read from a sharded checkpoint):
    `load_into` copies it into this rank's shard as it is, with no collective. Mark one with
    ``tensor.as_subclass(LocalShard)``."""


def load_into(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Copy a whole tensor into ``target`` (this rank's shard when ``target`` is a DTensor); returns ``target``.

    A `LocalShard` is this rank's shard already: copied into ``target``'s local tensor, shapes checked."""
    with torch.no_grad():
        if hasattr(target, "device_mesh") and isinstance(full, LocalShard):
            local = target.to_local()  # type: ignore[attr-defined]
            if tuple(full.shape) != tuple(local.shape):
                raise ValueError(f"a shard of shape {list(full.shape)} for this rank's shard {list(local.shape)}")
            local.copy_(full.as_subclass(torch.Tensor).to(local.device, local.dtype))
        elif hasattr(target, "device_mesh"):
            # deferred: torch.distributed.tensor takes 1.4 s to import, and only sharded runs have DTensors
            from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: PLC0415

            assert isinstance(target, DTensor)
            shard = distribute_tensor(full.to(target.device, target.dtype), target.device_mesh, target.placements)
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(full.to(target.device, target.dtype))
    return target


def release_process_group(rank: int, *, failed: BaseException | None) -> None:
    """End this rank's part in torchrun's process group. After a failure, this rank's error is printed first
    (``rank N: failed: ...``), and the group is aborted, not destroyed: the other ranks may be waiting in a collective
    this rank will never join, and a graceful destroy can wait for them (an FSDP run on two H200s hung so in cleanup,
    its error never printed); once this rank exits, torchrun stops the others."""
    if failed is not None:
        print(f"rank {rank}: failed: {type(failed).__name__}: {failed}", file=sys.stderr, flush=True)
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if failed is not None and abort is not None:
        abort()
    else:
        dist.destroy_process_group()
