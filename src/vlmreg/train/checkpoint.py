"""Checkpoints: trainable weights, optimizer state and RNG state in safetensors, plus a small JSON; atomic.

A checkpoint is written into a temporary folder and renamed into place, then ``latest`` is replaced
atomically, so a run killed at any moment leaves its last good checkpoint intact and findable. Sharded
(FSDP) parameters and optimizer states are saved whole, so a checkpoint does not depend on the number of
processes that wrote it; every rank's RNG state is kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vlmreg.sdk.errors import VlmregError
from vlmreg.train.distributed import Distributed, full_tensor, load_into

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(
    directory: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int = 2,
    ctx: Distributed | None = None,
) -> Path:
    """Write ``directory/step_{step:06d}`` atomically and point ``directory/latest`` at it (every rank calls it)."""
    final = directory / f"step_{step:06d}"
    params = _trainable(model)
    weights = {name: full_tensor(p) for name, p in params.items()}
    names = {id(p): name for name, p in params.items()}
    optim: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                optim[f"{names[id(p)]}::{key}"] = full_tensor(value if torch.is_tensor(value) else torch.tensor(value))
    ranks = ctx.gather_objects(_rng_state()) if ctx is not None else [_rng_state()]
    if ctx is not None and not ctx.is_main:
        return final
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp-step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(weights, tmp / "trainable.safetensors")
    save_file(optim, tmp / "optimizer.safetensors")
    save_file({f"{key}_rank{r}": value for r, rng in enumerate(ranks) for key, value in rng.items()}, tmp / "rng.safetensors")
    payload = {"step": step, "python_random": _jsonable(random.getstate()), **state}
    (tmp / "state.json").write_text(json.dumps(payload, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = directory / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, directory / "latest")
    for old in sorted(directory.glob("step_*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _tupled(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value


def latest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint ``latest`` points at, or ``None`` when there is none."""
    pointer = directory / "latest"
    if not pointer.is_file():
        return None
    path = directory / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, ctx: Distributed | None = None) -> dict[str, Any]:
    """Restore trainable weights (and optimizer and RNG state) in place; return the saved state dict."""
    params = _trainable(model)
    saved = load_file(path / "trainable.safetensors")
    if set(saved) != set(params):
        missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
        raise VlmregError(
            f"{path}: the checkpoint's trainable weights do not match this model's "
            f"(missing {missing[:3]}, unexpected {extra[:3]}); was it written with another [model] config?"
        )
    for name, p in params.items():
        load_into(p, saved[name])
    if optimizer is not None:
        optim = load_file(path / "optimizer.safetensors")
        for name, p in params.items():
            state = {}
            for key, value in optim.items():
                owner, _, field = key.partition("::")
                if owner == name:
                    # moments are shaped like the parameter (and sharded like it); the step count is a scalar
                    state[field] = load_into(torch.empty_like(p), value) if value.shape == saved[name].shape else value
            if state:
                optimizer.state[p] = state
    rng = load_file(path / "rng.safetensors")
    rank = ctx.rank if ctx is not None else 0
    if f"torch_cpu_rank{rank}" not in rng:
        raise VlmregError(f"{path}: no RNG state for rank {rank}; it was written by fewer processes")
    torch.set_rng_state(rng[f"torch_cpu_rank{rank}"])
    if torch.cuda.is_available() and f"torch_cuda_rank{rank}" in rng:
        torch.cuda.set_rng_state(rng[f"torch_cuda_rank{rank}"])
    state = json.loads((path / "state.json").read_text())
    random.setstate(_tupled(state.pop("python_random")))
    return state
