"""`gather_to_first`: an FSDP2 parameter's whole tensor on the one trainer rank that sends it, and nowhere else.

A sharded trainer's rank 0 sends every weight of a sync; the other ranks only hold rows of it. ``full_tensor()`` (an
all-gather) would give every rank the whole tensor, so rank 0 would also send its own rows to every other rank, on
the same links that carry the sync's broadcast out of it: for the 30B-A3B shape on 3 trainer ranks that is 41 GB
more leaving rank 0's GPU beside the sync's 61 GB. Here each other rank sends its rows to rank 0 only (a gather to
rank 0, straight into each rank's place in the whole tensor; where the rows do not divide evenly, the last ranks'
fewer rows through a spare block each and one copy), so rank 0's links carry
the rows coming in and the broadcast going out, in opposite directions.

On the other ranks the result is a meta tensor of the whole shape: they take part in the sync and never read a
value (`vlmreg.inference.server_link`, `vlmreg.broadcast.bench`). Parameters sharded otherwise than along their first
dimension over one mesh dimension (FSDP2's default) are gathered with ``full_tensor()`` on every rank, as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_to_first", "rows_of_each_rank"]


def rows_of_each_rank(rows: int, world: int) -> list[int]:
    """How many of ``rows`` each rank holds when a tensor is split along its first dimension as DTensor's ``Shard(0)``
    splits it (``torch.chunk``: ``ceil(rows / world)`` each, the last ranks fewer or none)."""
    each = -(-rows // world)
    return [max(0, min(rows, (r + 1) * each) - r * each) for r in range(world)]


def gather_to_first(parameter: Any) -> torch.Tensor:
    """``parameter``'s whole tensor on its mesh's first rank; on the other ranks their rows sent there and a meta
    tensor of the whole shape returned. A collective: every rank of the mesh calls it, in the same order."""
    mesh: Any = getattr(parameter, "device_mesh", None)
    placements: Any = getattr(parameter, "placements", ())
    if mesh is None or mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard(0):
        return parameter.full_tensor()
    group = mesh.get_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    local = parameter.to_local()
    rows = rows_of_each_rank(parameter.shape[0], world)
    each, rest = rows[0], tuple(parameter.shape[1:])
    if rows[rank] < each:  # gather takes the same size from every rank: the last ranks' rows padded
        padded = torch.zeros((each, *rest), dtype=local.dtype, device=local.device)
        padded[: rows[rank]].copy_(local)
        local = padded
    if rank != 0:
        dist.gather(local.contiguous(), None, group=group, group_dst=0)
        return torch.empty(parameter.shape, dtype=parameter.dtype, device="meta")
    whole = torch.empty(parameter.shape, dtype=local.dtype, device=local.device)
    short = [r for r in range(world) if rows[r] < each]  # the last ranks, when the rows do not divide evenly
    spares = list(torch.empty((len(short), each, *rest), dtype=local.dtype, device=local.device)) if short else []
    parts = [whole[r * each : (r + 1) * each] for r in range(world - len(short))]  # straight into place
    dist.gather(local.contiguous(), parts + spares, group=group, group_dst=0)
    for r, part in zip(short, spares, strict=True):
        if rows[r]:
            whole[r * each : r * each + rows[r]].copy_(part[: rows[r]])
    return whole
