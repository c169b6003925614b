"""Sharded checkpoints: a run FSDP2 shards over several processes saves one file per rank, never a gathered copy.

Gathering every weight and optimizer state to every rank's CPU (the whole layout) costs the whole model's state in
each rank's memory (about 160 GB per rank for a 15.7B-parameter MoE with AdamW) and minutes of collectives; here each
rank writes only what it holds. A step folder then has, for a run of N processes:

- ``trainable.rankRRRRR-of-NNNNN.safetensors`` and ``optimizer.rankRRRRR-of-NNNNN.safetensors``, one pair per rank,
  holding that rank's ``DTensor.to_local()`` of each trainable weight and optimizer state, under the whole layout's
  names (``NAME`` of each weight, ``NAME::exp_avg`` of its state); a tensor that is not sharded (the step count) is
  written whole by every rank, and a Python number (a third-party optimizer's step count) exactly, listed in the
  optimizer file's ``python_numbers`` metadata to be given back as a number, as the whole layout does. Each file's
  metadata says its rank and N.
- ``rng.safetensors`` (every rank's RNG state) and ``state.json``, whose ``sharded`` entry records N, by rank 0.

The save is one protocol across ranks (`write_own_shards`, then rank 0's commit in `checkpoint.save_checkpoint`):
rank 0 empties the temporary folder; each rank writes, reads back and fsyncs its own files; every rank's outcome is
gathered, and only when all succeeded does rank 0 find every rank's files and write its own (`finish_folder`)
and publish the folder. Any failure removes the temporary folder and ends the save on every rank with the failing
rank's message; ``latest`` keeps naming the last good checkpoint.

Resuming with N processes, each rank reads its own files; another number of processes, or one process without FSDP2
(``vlmreg eval``), reads its part from every rank's files (`reshard`). ``output_dir`` must be on a filesystem every
rank sees. This module reads and writes the shard files; `checkpoint` (which imports it) owns the folder protocol and
turns a `ShardError` into its `CheckpointError`.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vlmreg.durable import fsync_file
from vlmreg.train.distributed import Distributed, LocalShard

__all__ = [
    "SHARDED",
    "ShardError",
    "check_local",
    "check_names",
    "check_shards",
    "finish_folder",
    "give_back_numbers",
    "is_sharded",
    "listed_numbers",
    "marked",
    "optimizer_tensors",
    "recorded_world",
    "shard_files",
    "shard_name",
    "sharded_world",
    "write_own_shards",
    "write_verified",
]

#: ``state.json``'s entry for a sharded checkpoint: ``{"world_size": N}``
SHARDED = "sharded"
#: optimizer files' metadata key listing the states that were Python numbers (both layouts): as tensors they would
#: change the optimizer's arithmetic (float32, not float64; a tensor where the optimizer computes a Python number)
NUMBERS = "python_numbers"
NUMBER_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float}
KINDS = ("trainable", "optimizer")
SHARD_FILE = re.compile(r"(trainable|optimizer)\.rank(\d{5})-of-(\d{5})\.safetensors")
Part = tuple[dict[str, torch.Tensor], dict[str, str]]  # a file's tensors, and its metadata beside the rank and N


class ShardError(ValueError):
    """A shard file is missing, damaged or does not fit this rank's shards; the message names the file."""


def shard_name(kind: str, rank: int, world: int) -> str:
    """``trainable.rank00001-of-00004.safetensors``: the file of ``kind`` that ``rank`` of ``world`` writes."""
    return f"{kind}.rank{rank:05d}-of-{world:05d}.safetensors"


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def is_sharded(tensor: Any) -> bool:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local")  # a DTensor, without importing its module


def sharded_world(model: torch.nn.Module, ctx: Distributed | None) -> int | None:
    """The number of processes when FSDP2 shards the trainable weights over several, else ``None`` (whole files)."""
    if ctx is None or ctx.world <= 1:
        return None
    return ctx.world if any(is_sharded(p) for p in _trainable(model).values()) else None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor on the CPU (the whole tensor when it is not sharded)."""
    local: torch.Tensor = tensor.to_local() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]
    return local.detach().cpu().contiguous()  # on the CPU already: no copy (a GPU shard is copied over once)


def _own_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: _local(p) for name, p in _trainable(model).items()}


def optimizer_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, take: Callable[[Any], torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every optimizer state as a tensor under its checkpoint name (``NAME::key``), tensors through ``take`` (this
    rank's shard, or the whole tensor), Python numbers exactly (float64, int64) with their types by name: the states
    to list under ``NUMBERS``. Any other state is a `ShardError` naming it. Both layouts save through it."""
    names = {id(p): name for name, p in _trainable(model).items()}
    tensors: dict[str, torch.Tensor] = {}
    numbers: dict[str, str] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                name = f"{names[id(p)]}::{key}"
                if torch.is_tensor(value):
                    tensors[name] = take(value)
                elif isinstance(value, (bool, int, float)):  # exactly: float64, int64
                    tensors[name] = torch.tensor(
                        value, dtype=torch.float64 if isinstance(value, float) else torch.int64
                    )
                    numbers[name] = type(value).__name__
                else:
                    raise ShardError(
                        f"optimizer state {name!r} is a {type(value).__name__}: a checkpoint holds tensors and Python "
                        "numbers only"
                    )
    return tensors, numbers


def _own_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Part:
    """This rank's optimizer states, and the ``NUMBERS`` metadata listing those that are Python numbers."""
    tensors, numbers = optimizer_tensors(model, optimizer, _local)
    return tensors, {NUMBERS: json.dumps(numbers)}


# -- saving ---------------------------------------------------------------------------------


def write_own_shards(
    directory: Path, tmp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx: Distributed, rng: Any
) -> tuple[list[Any], str | None]:
    """Every rank: rank 0 makes ``tmp`` empty, then each rank writes its own two files into it (read back, fsynced).

    A collective. Returns every rank's ``rng`` (gathered, for rank 0 to write) and the first rank's failure message
    (naming the rank and the file), or ``None`` when every rank's files are written."""
    problem = _prepare(directory, tmp) if ctx.is_main else None
    gathered = ctx.gather_objects((rng, problem))  # after it, rank 0's temporary folder exists
    parts: dict[str, Callable[[], Part]] = {
        "trainable": lambda: (_own_weights(model), {}),
        "optimizer": lambda: _own_states(model, optimizer),
    }
    problem = gathered[0][1] or _write_own(tmp, ctx.rank, ctx.world, parts)
    problems = ctx.gather_objects(problem)
    return [value for value, _ in gathered], next(filter(None, problems), None)


def _prepare(directory: Path, tmp: Path) -> str | None:
    """Rank 0: an empty temporary folder, or why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:
        return f"rank 0: {exc.strerror or exc} ({exc.filename or tmp})"
    return None


def _write_own(tmp: Path, rank: int, world: int, parts: dict[str, Callable[[], Part]]) -> str | None:
    """This rank's two files, written, read back and fsynced; or why not (naming the rank and the file). Each file's
    tensors are taken (copied off a GPU) only for its write, so at most one file's worth is on the CPU at a time."""
    if not tmp.is_dir():
        return (
            f"rank {rank} does not see the folder {tmp} that rank 0 made: output_dir must be on a filesystem every "
            "rank sees (a shared one when the ranks run on several machines)"
        )
    path = tmp
    try:
        for kind, part in parts.items():
            path = tmp / shard_name(kind, rank, world)
            tensors, metadata = part()
            write_verified(tensors, path, {**metadata, "rank": str(rank), "world_size": str(world)})
            fsync_file(path)
    except Exception as exc:  # OSError, or safetensors' own error for a failed write
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return f"rank {rank}: {reason} ({path})"
    return None


def write_verified(
    tensors: dict[str, torch.Tensor],
    path: Path,
    metadata: dict[str, str] | None = None,
    *,
    save: Callable[..., Any] | None = None,
) -> None:
    """``save`` (safetensors' ``save_file``), then the header read back: a write that lost its tail (a full disk) is
    caught here, not at resume."""
    (save or save_file)(tensors, path, metadata=metadata)
    try:
        with safe_open(path, "pt") as f:
            written = set(f.keys())
    except Exception as exc:
        raise OSError(f"{path.name} is incomplete after writing ({exc}); is the disk full?") from exc
    if written != set(tensors):
        raise OSError(f"{path.name} is missing tensors after writing; is the disk full?")


def finish_folder(tmp: Path, world: int, problem: str | None, ranks: list[Any], state: dict[str, Any]) -> None:
    """Rank 0, once every rank reported: every rank's files are in ``tmp`` as rank 0 sees them; then every rank's
    RNG state (``rng.safetensors``) and ``state`` with the ``sharded`` entry (``state.json``). ``OSError`` when a rank
    failed (``problem``) or a file is missing; the caller publishes ``tmp`` or removes it."""
    if problem is not None:
        raise OSError(problem)
    for rank in range(world):
        for kind in KINDS:
            if not (tmp / shard_name(kind, rank, world)).is_file():
                raise OSError(
                    f"{tmp / shard_name(kind, rank, world)} is missing although rank {rank} wrote it: output_dir must "
                    "be on a filesystem every rank sees (a shared one when the ranks run on several machines)"
                )
    write_verified(
        {f"{key}_rank{r}": value for r, rng in enumerate(ranks) for key, value in rng.items()}, tmp / "rng.safetensors"
    )
    (tmp / "state.json").write_text(json.dumps({**state, SHARDED: {"world_size": world}}, indent=2), encoding="utf-8")


# -- finding and loading ---------------------------------------------------------------------


def _recorded_world(path: Path) -> int | None:
    """N from ``state.json``'s ``sharded`` entry, else from the shard files' names, else ``None`` (whole layout)."""
    try:
        entry = json.loads((path / "state.json").read_text(encoding="utf-8")).get(SHARDED)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        entry = None
    if isinstance(entry, dict) and type(entry.get("world_size")) is int:
        return int(entry["world_size"])
    found = [int(m.group(3)) for p in path.glob("*.rank*-of-*.safetensors") if (m := SHARD_FILE.fullmatch(p.name))]
    return max(found) if found else None


def shard_files(path: Path, optimizer: bool, world: int | None = None) -> list[str]:
    """Every file a complete sharded checkpoint in ``path`` has (the optimizer's when ``optimizer``): ``state.json``,
    ``rng.safetensors``, then each rank's; none when ``path`` holds the whole layout."""
    world = world if world is not None else _recorded_world(path)
    if world is None:
        return []
    kinds = KINDS if optimizer else KINDS[:1]
    return ["state.json", "rng.safetensors", *(shard_name(kind, r, world) for r in range(world) for kind in kinds)]


def _read_own(file: Path, rank: int, world: int) -> Part:
    if not file.is_file():
        raise ShardError(f"{file} is missing (an incomplete checkpoint)")
    try:
        with safe_open(file, "pt") as f:
            meta = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as exc:  # safetensors' error for a truncated or garbage file, or an OSError
        raise ShardError(f"{file} is damaged: it cannot be read as safetensors ({exc})") from exc
    if meta.get("rank") != str(rank) or meta.get("world_size") != str(world):
        raise ShardError(
            f"{file} says it is rank {meta.get('rank')} of {meta.get('world_size')}, not rank {rank} of {world}; "
            "was it renamed or copied from another checkpoint?"
        )
    return tensors, meta


def check_names(file: Path, saved: set[str], params: dict[str, Any]) -> None:
    """The trainable weights' names a checkpoint file holds (``saved``) against the model's; a `ShardError` naming
    ``file`` and the first few missing and unexpected names when they differ. Both layouts check through it."""
    if saved != set(params):
        missing, extra = sorted(set(params) - saved), sorted(saved - set(params))
        raise ShardError(
            f"{file}: the checkpoint's trainable weights do not match this model's "
            f"(missing {missing[:3]}, unexpected {extra[:3]}); was it written with another [model] config?"
        )


def check_local(file: Path, name: str, value: torch.Tensor, like: Any, what: str) -> None:
    """``value`` (from this rank's file) against this rank's part of ``like``: shape, dtype, finite values."""
    local = like.to_local() if is_sharded(like) else like
    if tuple(value.shape) != tuple(local.shape) or value.dtype != local.dtype:
        raise ShardError(
            f"{file}: {what} {name!r} is {value.dtype} {list(value.shape)}, this rank's shard of the model's is "
            f"{local.dtype} {list(local.shape)}; was it written with another [model] config?"
        )
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise ShardError(
            f"{file}: {what} {name!r} holds {bad} NaN or infinite value(s); the run diverged or the file is damaged"
        )


#: reads a sharded checkpoint written by another number of processes (`reshard.read_resharded`)
Reshard = Callable[
    [Path, int, dict[str, torch.nn.Parameter], torch.optim.Optimizer | None],
    tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]] | None],
]


def check_shards(
    path: Path,
    state: dict[str, Any],
    params: dict[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    ctx: Distributed | None,
    reshard: Reshard,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]] | None]:
    """This rank's weights and optimizer states from the sharded checkpoint ``path``, checked against this rank's
    shards of the model (``load_into`` copies them into the shards); nothing is applied. With as many processes as
    wrote it, each sharded the same, each rank reads its own files; otherwise (another number of processes, or a
    model not sharded) ``reshard`` reads this rank's part from every rank's files."""
    world = recorded_world(path, state)
    here = ctx.world if ctx is not None else 1
    problem: ShardError | None = None
    try:
        if here == world and any(is_sharded(p) for p in params.values()):
            own = _check_own(path, world, params, optimizer, ctx.rank if ctx is not None else 0)
        else:
            own = reshard(path, world, params, optimizer)
    except ShardError as exc:
        problem = exc
    # every rank takes the checkpoint or every rank skips it: a rank resuming another step than the others would
    # train on a mixture (one rank's damaged file is every rank's error)
    first = next(filter(None, ctx.gather_objects(str(problem) if problem else None)), None) if ctx else None
    if problem is not None:
        raise problem
    if first is not None:
        raise ShardError(first)
    return own


def recorded_world(path: Path, state: dict[str, Any]) -> int:
    """N, the number of processes that wrote the sharded checkpoint ``path``, from its ``state.json`` (``state``)."""
    entry = state[SHARDED]
    world = entry.get("world_size") if isinstance(entry, dict) else None
    if type(world) is not int or world < 1:
        raise ShardError(f"{path / 'state.json'} is damaged: {SHARDED!r} is {entry!r}, not {{'world_size': N}}")
    return world


def _check_own(
    path: Path,
    world: int,
    params: dict[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    rank: int,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]] | None]:
    """This rank's files read and checked (`check_shards`)."""
    file = path / shard_name("trainable", rank, world)
    saved, _ = _read_own(file, rank, world)
    check_names(file, set(saved), params)
    for name, p in params.items():
        check_local(file, name, saved[name], p, "weight")
    weights = {name: marked(value, params[name]) for name, value in saved.items()}
    if optimizer is None:
        return weights, None
    file = path / shard_name("optimizer", rank, world)
    moments: dict[str, dict[str, Any]] = {}
    tensors, meta = _read_own(file, rank, world)
    for key, value in tensors.items():
        owner, sep, field = key.rpartition("::")  # a module may be named with "::", a state key is not
        if not sep or owner not in params:
            raise ShardError(f"{file}: optimizer state {key!r} belongs to no trainable weight of this model")
        check_local(file, key, value, params[owner] if value.dim() else value, "optimizer state")
        moments.setdefault(owner, {})[field] = marked(value, params[owner]) if value.dim() else value
    give_back_numbers(file, meta, moments)
    return weights, moments


def listed_numbers(file: Path, meta: Mapping[str, str], is_scalar: Callable[[str], bool]) -> dict[str, type]:
    """The optimizer states ``file``'s metadata (``meta``) lists under ``NUMBERS`` (written as Python numbers), by key,
    with their type; each must name a scalar tensor of the file (``is_scalar``). A list that does not fit is a
    `ShardError` naming the file."""
    try:
        listed = json.loads(meta.get(NUMBERS, "{}"))
    except ValueError as exc:
        raise ShardError(f"{file} is damaged: its {NUMBERS!r} metadata is not JSON ({exc})") from exc
    if not isinstance(listed, dict) or any(
        not isinstance(kind, str) or kind not in NUMBER_TYPES or not is_scalar(key) for key, kind in listed.items()
    ):
        raise ShardError(
            f"{file} is damaged: its {NUMBERS!r} metadata is not a map from its scalars to {sorted(NUMBER_TYPES)}"
        )
    return {key: NUMBER_TYPES[kind] for key, kind in listed.items()}


def give_back_numbers(file: Path, meta: dict[str, str], moments: dict[str, dict[str, Any]]) -> None:
    """The optimizer states ``file``'s metadata (``meta``) lists under ``NUMBERS``, read as scalar tensors into
    ``moments``, made Python numbers again, in place; a list that does not fit is a `ShardError` naming the file."""

    def scalar(key: str) -> bool:
        owner, _, field = key.rpartition("::")
        value = moments.get(owner, {}).get(field)
        return torch.is_tensor(value) and value.dim() == 0

    for key, kind in listed_numbers(file, meta, scalar).items():
        owner, _, field = key.rpartition("::")
        moments[owner][field] = kind(moments[owner][field].item())


def marked(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A shard of a sharded weight (or of its state) as a `LocalShard`: `load_into` copies it with no collective."""
    return value.as_subclass(LocalShard) if is_sharded(like) else value
