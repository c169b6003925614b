"""Room for a sync beside a launched vLLM on a GPU of its own.

A vLLM worker that receives syncs through a process group (``broadcast.transport = "nccl"`` or ``"gloo"``,
``rollout.launch_gpu = "next"``) stages each sync whole on its GPU before writing it into the model
(`vlmreg.broadcast.receiver`), outside the share of the GPU that ``--gpu-memory-utilization`` gives vLLM. At vLLM's
usual 0.9 a large model leaves too little: measured on an H200 (139.8 GiB) with the Qwen3-VL-30B-A3B shape at 24
layers, the worker's 30.0 GiB staging buffer did not fit beside 0.9 and the first sync failed with CUDA out of
memory, three minutes into the run; at 0.55 it synced every step (BENCHMARKS.md, "Mixture of experts on 4 GPUs").
`launch_fraction` works the share out before vLLM starts: an unset ``rollout.gpu_memory_fraction`` is lowered to
leave the room (and the log says so), a set one that leaves too little is an error naming it, and a GPU that cannot
hold vLLM's weights and a staged copy of them is an error too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from vlmreg.broadcast import WeightPlan
from vlmreg.config.resolve import ResolvedConfig
from vlmreg.inference.server_process import server_gpu_indices
from vlmreg.inference.vllm_launch import default_fraction, tensor_parallel_size
from vlmreg.resolution import ResolvedFamily
from vlmreg.sdk.errors import VlmregError

__all__ = ["MARGIN_BYTES", "STAGING_TRANSPORTS", "launch_fraction", "room_for_syncs", "staged_bytes"]

#: Transports whose vLLM workers stage each sync on their GPU (vlmreg's own receivers).
STAGING_TRANSPORTS = frozenset({"nccl", "gloo"})
#: Left free beside vLLM's share and the staging buffer: the worker's CUDA context, NCCL's buffers, allocator slack.
MARGIN_BYTES = 2 * 2**30
#: vLLM's share must hold its weights and at least this much more (KV cache, activations, CUDA graphs).
KV_FLOOR_BYTES = 4 * 2**30

GIB = 2**30


def staged_bytes(resolved: ResolvedFamily) -> int:
    """The bytes of the largest sync (the full one, frozen vision weights included), which a worker stages whole;
    read off the parameters' shapes (an FSDP2 shard counts whole), nothing gathered."""
    plan = WeightPlan.from_resolved(resolved, include_frozen_vision=True)
    return sum(w.parameter.numel() * w.parameter.element_size() for w in plan.weights)


def launch_fraction(
    setting: float | None, default: float, *, total_bytes: int, staged: int, weights: int, gpu: str
) -> tuple[float, str | None]:
    """vLLM's share of GPU ``gpu`` (``total_bytes``) so that a staged sync of ``staged`` bytes fits beside it, and a
    line for the log when an unset ``rollout.gpu_memory_fraction`` (``setting``) was lowered from ``default``."""
    need = staged + MARGIN_BYTES
    fits = math.floor((total_bytes - need) / total_bytes * 100) / 100  # the largest share (hundredths) leaving it
    if weights + KV_FLOOR_BYTES > fits * total_bytes:
        raise VlmregError(
            f"GPU {gpu} ({total_bytes / GIB:.1f} GiB) cannot hold vLLM's weights ({weights / GIB:.1f} GiB, plus room "
            f"for its KV cache) and a staged copy of each sync ({staged / GIB:.1f} GiB, which its workers receive "
            "whole before writing it in): give the server more GPUs (rollout.server_args = ['--tensor-parallel-size', "
            "'2'] spreads its weights, not the staging), train fewer layers, or sync through transport = \"ipc\" on "
            "the trainer's GPU"
        )
    if setting is None:
        if default <= fits:
            return default, None
        return fits, (
            f"vLLM on GPU {gpu} gets {fits:.2f} of its memory, not {default:g}: its workers stage each sync whole "
            f"({staged / GIB:.1f} GiB) outside vLLM's share (set rollout.gpu_memory_fraction to choose)"
        )
    if setting > fits:
        raise VlmregError(
            f"rollout.gpu_memory_fraction = {setting:g} leaves {(1 - setting) * total_bytes / GIB:.1f} GiB of GPU "
            f"{gpu} ({total_bytes / GIB:.1f} GiB) beside vLLM, but its workers stage each sync whole outside that "
            f"share: {staged / GIB:.1f} GiB and {MARGIN_BYTES / GIB:.0f} GiB of margin; set it to at most "
            f"{fits:.2f}, or leave it unset"
        )
    return setting, None


def room_for_syncs(
    rc: ResolvedConfig, resolved: ResolvedFamily, device: torch.device, log: Callable[[str], Any]
) -> float | None:
    """vLLM's share of its GPU(s) for the servers this trainer launches, where its workers stage syncs on a GPU of
    their own (``launch_gpu = "next"``, a staging transport); ``None`` elsewhere (the setting or its default holds)."""
    rollout = rc.config.rollout
    if rollout.launch_gpu != "next" or rc.config.broadcast.transport not in STAGING_TRANSPORTS:
        return None
    tp = tensor_parallel_size(rollout.server_args)
    gpus = [i for k in range(rollout.server_count) for i in server_gpu_indices(device, "next", tp, k)]
    if not gpus or max(gpus) >= torch.cuda.device_count():
        return None  # server_gpus names the missing GPU when the servers start
    total = min(torch.cuda.get_device_properties(i).total_memory for i in gpus)
    staged = staged_bytes(resolved)
    fraction, note = launch_fraction(
        rollout.gpu_memory_fraction,
        default_fraction(rc),
        total_bytes=total,
        staged=staged,
        weights=staged // tp,
        gpu=",".join(map(str, gpus)),
    )
    if note:
        log(note)
    return fraction
