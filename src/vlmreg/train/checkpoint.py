"""Checkpoints: trainable weights, optimizer state and RNG state in safetensors, plus a small JSON; atomic.

A checkpoint is written into a temporary folder, each file read back, and the folder renamed into place; then
``latest`` (a bare ``step_NNNNNN`` name) is replaced atomically, so a run killed at any moment leaves its last good
checkpoint intact and findable. A write that fails (a full disk) removes its temporary folder and is an error naming
the path; ``latest`` still names the last good checkpoint. Retention only counts ``step_NNNNNN`` folders, in step
order, and never deletes the one ``latest`` names.

Loading checks everything before anything is applied (file readable, names, shapes, dtypes, finite values, JSON,
RNG state), so a damaged checkpoint is an error naming the file at fault, and `resume_checkpoint` falls back to the
newest earlier checkpoint that passes, with a warning naming what it skipped. One process saves whole tensors; a run
FSDP2 shards over several processes saves one file per rank (`shard_checkpoint`), which any number of processes
loads (`reshard` when the number differs). Every rank's RNG state is kept; a rank the checkpoint has none for (more
processes than wrote it) starts from a state derived from rank 0's and its own rank, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vlmreg.durable import fsync_dir, fsync_tree
from vlmreg.sdk.errors import VlmregError
from vlmreg.train import shard_checkpoint as shards
from vlmreg.train.distributed import Distributed, full_tensor, load_into
from vlmreg.train.reshard import read_resharded

__all__ = [
    "CheckpointError",
    "checkpoint_steps",
    "latest_checkpoint",
    "load_checkpoint",
    "resume_checkpoint",
    "save_checkpoint",
]

STEP_NAME = re.compile(r"step_(\d{6,})")
# optimizer.safetensors too, when resuming training
REQUIRED = ("state.json", "trainable.safetensors", "rng.safetensors")
# optimizer.safetensors' metadata key listing the states that were Python numbers (SparseAdam's step count), so they
# are given back as Python numbers: as tensors they would change the optimizer's arithmetic (float32, not float64);
# one key for both layouts
NUMBERS, NUMBER_TYPES = shards.NUMBERS, shards.NUMBER_TYPES
_logger = logging.getLogger(__name__)


class CheckpointError(VlmregError):
    """A checkpoint is missing, incomplete, damaged or does not fit the model; the message names the file at fault."""


def _warn(message: str) -> None:
    _logger.warning(message)


def checkpoint_steps(directory: Path) -> list[tuple[int, Path]]:
    """The ``step_NNNNNN`` folders in ``directory`` as ``(step, path)``, in step order; other names are ignored."""
    if not directory.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in directory.iterdir()
        if (m := STEP_NAME.fullmatch(p.name)) and p.is_dir() and not p.is_symlink()
    ]
    return sorted(found)


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


# -- saving ---------------------------------------------------------------------------------


def save_checkpoint(
    directory: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int = 2,
    ctx: Distributed | None = None,
) -> Path:
    """Write ``directory/step_{step:06d}`` atomically and point ``directory/latest`` at it (every rank calls it).

    Keeps the ``keep`` newest checkpoints up to this one. A failed write raises `CheckpointError` naming the path,
    after removing the partial folder; the previous checkpoint and ``latest`` are left as they were.
    """
    final = directory / f"step_{step:06d}"
    if (
        ctx is not None and shards.sharded_world(model, ctx) is not None
    ):  # FSDP2 over several ranks: each writes its own
        return _save_sharded(directory, step, model, optimizer, state, keep, ctx)
    params = _trainable(model)
    weights = {name: full_tensor(p) for name, p in params.items()}
    try:
        optim, numbers = shards.optimizer_tensors(model, optimizer, full_tensor)
    except shards.ShardError as exc:
        raise CheckpointError(str(exc)) from exc
    ranks = ctx.gather_objects(_rng_state()) if ctx is not None else [_rng_state()]
    if ctx is not None and not ctx.is_main:
        return final
    tmp = directory / f".tmp-step_{step:06d}"
    payload = json.dumps({"step": step, "python_random": _jsonable(random.getstate()), **state}, indent=2)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _write_tensors(weights, tmp / "trainable.safetensors")
        _write_tensors(optim, tmp / "optimizer.safetensors", {NUMBERS: json.dumps(numbers)})
        _write_tensors(
            {f"{key}_rank{r}": value for r, rng in enumerate(ranks) for key, value in rng.items()},
            tmp / "rng.safetensors",
        )
        with open(tmp / "state.json", "w", encoding="utf-8") as f:
            f.write(payload)
        _publish(tmp, final, directory)
    except Exception as exc:  # OSError, or safetensors' own error for a failed write (e.g. "No space left on device")
        raise _failure(exc, tmp, final, directory) from exc
    _prune(directory, step, keep)
    return final


def _save_sharded(
    directory: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int,
    ctx: Distributed,
) -> Path:
    """Each rank writes its own shards; once all have, rank 0 adds RNG and state and publishes. One rank's failure is
    the error on every rank (`shard_checkpoint`)."""
    final, tmp = directory / f"step_{step:06d}", directory / f".tmp-step_{step:06d}"
    ranks, problem = shards.write_own_shards(directory, tmp, model, optimizer, ctx, _rng_state())
    message = None
    if ctx.is_main:
        try:
            payload = {"step": step, "python_random": _jsonable(random.getstate()), **state}
            shards.finish_folder(tmp, ctx.world, problem, ranks, payload)
            _publish(tmp, final, directory)
        except Exception as exc:  # as in `save_checkpoint`
            message = str(_failure(exc, tmp, final, directory))
        else:
            _prune(directory, step, keep)
    message = ctx.gather_objects(message)[0]  # rank 0's outcome, on every rank
    if message is not None:
        raise CheckpointError(message)
    return final


def _publish(tmp: Path, final: Path, directory: Path) -> None:
    """Make the written ``tmp`` folder the checkpoint ``final`` and point ``latest`` at it."""
    # the files are on disk before the rename makes them the checkpoint (a power cut, not only kill -9)
    fsync_tree(tmp)
    old = directory / f".tmp-old-{final.name}"
    if final.exists():  # the same step written again (a run resumed from before it): swap, never a gap
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    pointer = directory / ".latest.tmp"
    with open(pointer, "w", encoding="utf-8") as f:
        f.write(final.name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, directory / "latest")
    fsync_dir(directory)


def _failure(exc: BaseException, tmp: Path, final: Path, directory: Path) -> CheckpointError:
    """The partial ``tmp`` folder removed; the error naming ``final``, why, and what ``latest`` still names."""
    shutil.rmtree(tmp, ignore_errors=True)
    current = _pointer_name(directory)
    kept = f"{directory / 'latest'} still names {current}" if current else "there is no earlier checkpoint"
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return CheckpointError(
        f"could not write checkpoint {final}: {reason}; the partial {tmp.name} was removed and {kept}"
    )


def _write_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    shards.write_verified(tensors, path, metadata, save=save_file)  # this module's save_file, looked up at each call


def _prune(directory: Path, step: int, keep: int) -> None:
    """Delete all but the ``keep`` newest ``step_NNNNNN`` folders up to ``step``, never the one ``latest`` names."""
    for leftover in directory.glob(".tmp-*step_*"):  # partial folders of a run killed while writing
        shutil.rmtree(leftover, ignore_errors=True)
    if keep <= 0:
        return
    current = _pointer_name(directory)
    mine = [path for number, path in checkpoint_steps(directory) if number <= step]
    for path in mine[:-keep]:
        if path.name != current:
            shutil.rmtree(path, ignore_errors=True)


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _tupled(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value


# -- finding ---------------------------------------------------------------------------------


def _pointer_name(directory: Path) -> str | None:
    """The ``step_NNNNNN`` name ``latest`` holds, or ``None`` when it is absent or holds anything else."""
    try:
        name = (directory / "latest").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if STEP_NAME.fullmatch(name) else None


def _candidates(directory: Path, log: Callable[[str], None]) -> list[Path]:
    """Checkpoints to try, newest first: the one ``latest`` names, then earlier ones (a warning for a bad pointer)."""
    steps = checkpoint_steps(directory)
    pointer = directory / "latest"
    limit: int | None = None
    if pointer.exists() or pointer.is_symlink():
        name = _pointer_name(directory)
        if name is None:
            log(
                f"warning: {pointer} does not hold a step_NNNNNN name in this folder; ignored, trying the newest "
                "checkpoint"
            )
        else:
            limit = int(STEP_NAME.fullmatch(name).group(1))  # type: ignore[union-attr]
            if all(path.name != name for _, path in steps):
                log(
                    f"warning: {pointer} names {name}, which does not exist (as a folder); trying the newest earlier "
                    "checkpoint"
                )
    elif steps:
        log(f"warning: {pointer} is missing; trying the newest checkpoint")
    return [path for number, path in reversed(steps) if limit is None or number <= limit]


def _check_complete(path: Path, optimizer: bool) -> None:
    sharded = shards.shard_files(path, optimizer)  # one file per rank: all of them
    for name in sharded or (*REQUIRED, *(("optimizer.safetensors",) if optimizer else ())):
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name} is missing (an incomplete checkpoint)")


def latest_checkpoint(directory: Path, log: Callable[[str], None] = _warn) -> Path | None:
    """The checkpoint ``latest`` points at, else the newest complete earlier one (warning why), or ``None``."""
    for path in _candidates(directory, log):
        try:
            _check_complete(path, optimizer=False)
        except CheckpointError as exc:
            log(f"warning: skipped checkpoint {path.name}: {exc}")
            continue
        return path
    return None


# -- loading ---------------------------------------------------------------------------------


@attrs.frozen
class _Checked:
    """A checkpoint read and checked against the model, not yet applied."""

    path: Path
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, Any]] | None  # tensors, and Python numbers where the optimizer kept those
    rng_cpu: torch.Tensor
    rng_cuda: torch.Tensor | None
    state: dict[str, Any]


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing (an incomplete checkpoint)")
    try:
        return load_file(file)
    except Exception as exc:  # safetensors' error for a truncated or garbage file, or an OSError
        raise CheckpointError(f"{file} is damaged: it cannot be read as safetensors ({exc})") from exc


def _python_numbers(file: Path, tensors: dict[str, torch.Tensor]) -> dict[str, type]:
    """The optimizer states `save_checkpoint` found as Python numbers, by name, with their type."""
    try:
        with safe_open(file, "pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors' error
        raise CheckpointError(f"{file} is damaged: its {NUMBERS!r} metadata cannot be read ({exc})") from exc
    try:
        return shards.listed_numbers(file, meta, lambda key: key in tensors and tensors[key].dim() == 0)
    except shards.ShardError as exc:
        raise CheckpointError(str(exc)) from exc


def _check_tensor(file: Path, name: str, value: torch.Tensor, like: torch.Tensor, what: str) -> None:
    if tuple(value.shape) != tuple(like.shape):
        raise CheckpointError(
            f"{file}: {what} {name!r} has shape {list(value.shape)}, this model's is {list(like.shape)}; "
            f"was it written with another [model] config?"
        )
    if value.dtype != like.dtype:
        raise CheckpointError(
            f"{file}: {what} {name!r} is {value.dtype}, this model's is {like.dtype}; was it written with another "
            "[model] config?"
        )
    _check_finite(file, name, value, what)


def _check_finite(file: Path, name: str, value: torch.Tensor, what: str) -> None:
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise CheckpointError(
            f"{file}: {what} {name!r} holds {bad} NaN or infinite value(s); the run diverged or the file is damaged"
        )


def _read_state(path: Path) -> dict[str, Any]:
    file = path / "state.json"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing (an incomplete checkpoint)")
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{file} is damaged: not JSON ({exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} is damaged: a JSON object was expected, found {type(state).__name__}")
    step = state.get("step")
    if type(step) is not int or step < 0:
        raise CheckpointError(f"{file} is damaged: 'step' is {step!r}, not a step number")
    match = STEP_NAME.fullmatch(path.name)
    if match and int(match.group(1)) != step:
        raise CheckpointError(f"{file} is damaged: it says step {step} in folder {path.name}")
    try:
        random.Random().setstate(_tupled(state["python_random"]))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise CheckpointError(
            f"{file} is damaged: 'python_random' is not a Python RNG state ({type(exc).__name__}: {exc})"
        ) from exc
    return state


def _check(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, ctx: Distributed | None
) -> _Checked:
    """Read every file of the checkpoint and check it against the model; nothing is applied."""
    state = _read_state(path)
    params = _trainable(model)
    if shards.SHARDED in state:  # one file per rank (shard_checkpoint): this rank's shards
        try:
            own = shards.check_shards(path, state, params, optimizer, ctx, read_resharded)
        except shards.ShardError as exc:
            raise CheckpointError(str(exc)) from exc
        return _Checked(path, *own, *_check_rng(path, ctx), state)
    file = path / "trainable.safetensors"
    saved = _read_tensors(file)
    try:
        shards.check_names(file, set(saved), params)
    except shards.ShardError as exc:
        raise CheckpointError(str(exc)) from exc
    for name, p in params.items():
        _check_tensor(file, name, saved[name], p, "weight")
    moments: dict[str, dict[str, Any]] | None = None
    if optimizer is not None:
        file = path / "optimizer.safetensors"
        moments = {}
        tensors = _read_tensors(file)
        numbers = _python_numbers(file, tensors)
        for key, value in tensors.items():
            owner, sep, field = key.rpartition("::")  # a module may be named with "::", a state key is not
            if not sep or owner not in params:
                raise CheckpointError(f"{file}: optimizer state {key!r} belongs to no trainable weight of this model")
            if value.dim() == 0:  # the step count
                _check_finite(file, key, value, "optimizer state")
            else:  # moments are shaped like the parameter
                _check_tensor(file, key, value, params[owner], "optimizer state")
            moments.setdefault(owner, {})[field] = numbers[key](value.item()) if key in numbers else value
    return _Checked(path, saved, moments, *_check_rng(path, ctx), state)


def _check_rng(path: Path, ctx: Distributed | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's RNG states from ``rng.safetensors``, checked; nothing is applied. A rank it has none for (the
    checkpoint was written by fewer processes) gets a CPU state derived from rank 0's and its rank, and no CUDA one."""
    file = path / "rng.safetensors"
    rng = _read_tensors(file)
    rank = ctx.rank if ctx is not None else 0
    key = f"torch_cpu_rank{rank}" if f"torch_cpu_rank{rank}" in rng else "torch_cpu_rank0"
    cpu = rng.get(key)
    if cpu is None:
        raise CheckpointError(f"{file} is damaged: it has no RNG state for rank 0")
    expected = torch.get_rng_state()
    if cpu.dtype != expected.dtype or cpu.shape != expected.shape:
        raise CheckpointError(f"{file} is damaged: {key} is {cpu.dtype} {list(cpu.shape)}, not a CPU RNG state")
    generator = torch.Generator()
    try:  # the right size, but torch may still refuse its content: found here, before anything is applied
        generator.set_state(cpu)
    except RuntimeError as exc:
        raise CheckpointError(f"{file} is damaged: {key} is not a CPU RNG state ({exc})") from exc
    if key != f"torch_cpu_rank{rank}":  # each rank its own stream, the same on every resume
        seed = int(torch.randint(0, 2**62, (1,), generator=generator)) + rank
        _warn(
            f"warning: {file} has no RNG state for rank {rank} (fewer processes wrote it); its CPU RNG starts from "
            f"seed {seed}, drawn from rank 0's state, and its CUDA RNG is left as it is"
        )
        return torch.Generator().manual_seed(seed).get_state(), None
    cuda = rng.get(f"torch_cuda_rank{rank}") if torch.cuda.is_available() else None
    if cuda is not None and (cuda.dtype != torch.uint8 or cuda.dim() != 1):
        raise CheckpointError(
            f"{file} is damaged: torch_cuda_rank{rank} is {cuda.dtype} {list(cuda.shape)}, not a CUDA RNG state"
        )
    return cpu, cuda


def _apply(checked: _Checked, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    params = _trainable(model)
    for name, p in params.items():
        load_into(p, checked.weights[name])
    if optimizer is not None and checked.optimizer is not None:
        for name, p in params.items():
            fields = checked.optimizer.get(name)
            if fields:  # moments are sharded like the parameter; the step count is a scalar
                optimizer.state[p] = {
                    k: load_into(torch.empty_like(p), v) if torch.is_tensor(v) and v.dim() else v
                    for k, v in fields.items()
                }
    try:
        torch.set_rng_state(checked.rng_cpu)
        if checked.rng_cuda is not None:
            torch.cuda.set_rng_state(checked.rng_cuda)
    except RuntimeError as exc:  # a CUDA state torch refuses (the CPU one was tried in `_check`)
        raise CheckpointError(f"{checked.path / 'rng.safetensors'} is damaged: {exc}") from exc
    state = dict(checked.state)
    random.setstate(_tupled(state.pop("python_random")))
    return state


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, ctx: Distributed | None = None
) -> dict[str, Any]:
    """Restore trainable weights (and optimizer and RNG state) in place; return the saved state dict.

    Everything is checked before anything is applied; a problem raises `CheckpointError` naming the file.
    """
    return _apply(_check(path, model, optimizer, ctx), model, optimizer)


def resume_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ctx: Distributed | None = None,
    *,
    log: Callable[[str], None] = _warn,
    check_state: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Load the checkpoint ``latest`` names or, when it is missing or damaged, the newest earlier one that is good.

    Each checkpoint skipped is a warning (through ``log``) naming the file at fault. ``check_state(state)`` may
    reject a checkpoint's ``state.json`` content by raising ``KeyError``, ``TypeError`` or ``ValueError``; it runs
    before anything is applied. Raises `CheckpointError` listing every checkpoint tried when none is good.
    """
    skipped: list[str] = []
    for path in _candidates(directory, log):
        try:
            _check_complete(path, optimizer=optimizer is not None)
            checked = _check(path, model, optimizer, ctx)
            if check_state is not None:
                try:
                    check_state(checked.state)
                except (KeyError, TypeError, ValueError) as exc:
                    raise CheckpointError(f"{path / 'state.json'} is damaged: {type(exc).__name__}: {exc}") from exc
        except CheckpointError as exc:
            log(f"warning: skipped checkpoint {path.name}: {exc}")
            skipped.append(str(exc))
            continue
        state = _apply(checked, model, optimizer)
        written, here = state.get(shards.SHARDED, {}).get("world_size"), ctx.world if ctx is not None else 1
        if written is not None and written != here:
            log(f"{path.name} was written by {written} processes and is read by {here} (resharded)")
        if skipped:
            log(
                f"warning: resuming from {path.name}, the newest good checkpoint, after skipping {len(skipped)} newer "
                "one(s)"
            )
        return path, state
    if not skipped:
        raise CheckpointError(f"no checkpoint in {directory}")
    raise CheckpointError(f"no usable checkpoint in {directory}: " + "; ".join(skipped))
