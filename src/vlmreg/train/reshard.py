"""Reading a sharded checkpoint into another number of processes: FSDP2's shards of N ranks, loaded by M.

FSDP2 splits each weight (and each optimizer state shaped like it) along its first dimension as ``torch.chunk``
does: with ``c = ceil(rows / N)``, rank ``r`` holds rows ``[r * c, min((r + 1) * c, rows))``, and a rank past the end
holds none. A sharded checkpoint keeps each rank's rows in that rank's file (`shard_checkpoint`), so the rows of one
tensor, read from the N files in rank order, are the whole tensor.

Here a process of another layout reads, for each tensor, only the rows it needs, slice by slice from the files that
hold them (safetensors reads a slice without loading the rest): under FSDP2 with M ranks, this rank's chunk of M;
in one process (``vlmreg eval --checkpoint``, or a run resumed on one GPU), the whole tensor. A rank's memory holds
its own shard, never the whole model. A tensor that is not sharded (an optimizer's step count) is written whole by
every rank and read from rank 0's file.

Everything is checked as for a checkpoint of the same layout: each file's metadata (rank and N), the names against
the model's, each tensor's rows across the files against the model's shape, dtypes, finite values.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from vlmreg.train.shard_checkpoint import (
    ShardError,
    check_local,
    check_names,
    give_back_numbers,
    is_sharded,
    marked,
    shard_name,
)

__all__ = ["read_resharded", "rows_of"]


def rows_of(like: torch.Tensor) -> tuple[int, int]:
    """The rows of dim 0 that ``like`` holds here: this rank's FSDP2 chunk of a sharded tensor, else all of them."""
    rows = like.shape[0]
    if not is_sharded(like):
        return 0, rows
    mesh, placements = like.device_mesh, like.placements  # type: ignore[attr-defined]
    if len(placements) != 1 or getattr(placements[0], "dim", None) != 0:
        raise ShardError(f"a shard placed as {placements}: vlmreg reshards only FSDP2's default placement (dim 0)")
    per = math.ceil(rows / mesh.size())
    start = min(mesh.get_local_rank() * per, rows)
    end = min(start + per, rows)
    local = like.to_local().shape[0]  # type: ignore[attr-defined]
    if local != end - start:
        raise ShardError(
            f"this rank's shard has {local} of {rows} rows, not the {end - start} FSDP2's split by dim 0 gives; "
            "vlmreg reshards only FSDP2's default placement (dim 0)"
        )
    return start, end


class _Files:
    """The N files of one kind, opened for reading slices; each file's rows of every tensor, from the headers."""

    def __init__(self, stack: contextlib.ExitStack, path: Path, kind: str, world: int) -> None:
        self.paths = [path / shard_name(kind, r, world) for r in range(world)]
        self.files = [self._open(stack, file, r, world) for r, file in enumerate(self.paths)]
        self.names = set(self.files[0].keys())
        for file, opened in zip(self.paths[1:], self.files[1:], strict=True):
            if set(opened.keys()) != self.names:
                raise ShardError(f"{file} holds other tensors than {self.paths[0].name}; the checkpoint is damaged")

    @staticmethod
    def _open(stack: contextlib.ExitStack, file: Path, rank: int, world: int) -> Any:
        if not file.is_file():
            raise ShardError(f"{file} is missing (an incomplete checkpoint)")
        try:
            opened = stack.enter_context(safe_open(file, "pt"))
        except Exception as exc:  # safetensors' error for a truncated or garbage file, or an OSError
            raise ShardError(f"{file} is damaged: it cannot be read as safetensors ({exc})") from exc
        meta = opened.metadata() or {}
        if meta.get("rank") != str(rank) or meta.get("world_size") != str(world):
            raise ShardError(
                f"{file} says it is rank {meta.get('rank')} of {meta.get('world_size')}, not rank {rank} of "
                f"{world}; was it renamed or copied from another checkpoint?"
            )
        return opened

    def read_whole(self, name: str, what: str) -> torch.Tensor:
        """A tensor every rank wrote whole (an optimizer's step count), from rank 0's file; checked."""
        value = self.files[0].get_tensor(name)
        check_local(self.paths[0], name, value, value, what)
        return value

    def read(self, name: str, like: torch.Tensor, what: str) -> torch.Tensor:
        """The rows of ``name`` that ``like`` holds here, joined from the files that have them; checked."""
        start, end = rows_of(like)
        parts, at = [], 0
        for file, opened in zip(self.paths, self.files, strict=True):
            part = opened.get_slice(name)
            shape = part.get_shape()
            if list(shape[1:]) != list(like.shape[1:]):
                raise ShardError(
                    f"{file}: {what} {name!r} has rows of shape {shape[1:]}, the model's are {list(like.shape[1:])}; "
                    "was it written with another [model] config?"
                )
            low, high = max(start, at), min(end, at + shape[0])
            if low < high:
                piece = part[low - at : high - at]
                check_local(file, name, piece, piece, what)  # non-finite values: named by the file that has them
                parts.append(piece)
            at += shape[0]
        if at != like.shape[0]:
            raise ShardError(
                f"{self.paths[0].parent}: {what} {name!r} has {at} rows across the {len(self.paths)} ranks' files, "
                f"the model's has {like.shape[0]}; was it written with another [model] config?"
            )
        value = torch.cat(parts) if parts else self.files[0].get_slice(name)[0:0]
        check_local(self.paths[0].parent, name, value, like, what)
        return value


def read_resharded(
    path: Path,
    world: int,
    params: dict[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]] | None]:
    """This process's part of every weight (and optimizer state) of the checkpoint ``path``, which ``world``
    processes wrote: the rows its shards hold (the whole tensors when the model is not sharded), checked."""
    with contextlib.ExitStack() as stack:
        weights = _Files(stack, path, "trainable", world)
        check_names(weights.paths[0], weights.names, params)
        own = {name: marked(weights.read(name, p, "weight"), p) for name, p in params.items()}
        if optimizer is None:
            return own, None
        states = _Files(stack, path, "optimizer", world)
        moments: dict[str, dict[str, Any]] = {}
        for key in sorted(states.names):
            owner, sep, field = key.rpartition("::")  # a module may be named with "::", a state key is not
            if not sep or owner not in params:
                raise ShardError(
                    f"{states.paths[0]}: optimizer state {key!r} belongs to no trainable weight of this model"
                )
            if states.files[0].get_slice(key).get_shape():  # shaped like its weight: rows as the weight's
                value = marked(states.read(key, params[owner], "optimizer state"), params[owner])
            else:
                value = states.read_whole(key, "optimizer state")
            moments.setdefault(owner, {})[field] = value
        give_back_numbers(states.paths[0], states.files[0].metadata() or {}, moments)  # Python numbers, as written
        return own, moments
