"""Checkpoints: trainable weights, optimizer state and RNG state in safetensors, plus a small JSON; atomic.

A checkpoint is written into a temporary folder and renamed into place, then ``latest`` is replaced
atomically, so a run killed at any moment leaves its last good checkpoint intact and findable.
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

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(directory: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``directory/step_{step:06d}`` atomically and point ``directory/latest`` at it."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"step_{step:06d}"
    tmp = directory / f".tmp-step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    params = _trainable(model)
    save_file({name: p.detach().contiguous().cpu() for name, p in params.items()}, tmp / "trainable.safetensors")
    names = {id(p): name for name, p in params.items()}
    optim: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                tensor = value if torch.is_tensor(value) else torch.tensor(value)
                optim[f"{names[id(p)]}::{key}"] = tensor.detach().contiguous().cpu()
    save_file(optim, tmp / "optimizer.safetensors")
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, tmp / "rng.safetensors")
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


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Restore trainable weights (and optimizer and RNG state) in place; return the saved state dict."""
    params = _trainable(model)
    saved = load_file(path / "trainable.safetensors")
    if set(saved) != set(params):
        missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
        raise VlmregError(
            f"{path}: the checkpoint's trainable weights do not match this model's "
            f"(missing {missing[:3]}, unexpected {extra[:3]}); was it written with another [model] config?"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name].to(p.device, p.dtype))
    if optimizer is not None:
        optim = load_file(path / "optimizer.safetensors")
        for name, p in params.items():
            state = {key.split("::", 1)[1]: value.to(p.device) for key, value in optim.items() if key.split("::", 1)[0] == name}
            if state:
                optimizer.state[p] = state
    rng = load_file(path / "rng.safetensors")
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available() and "torch_cuda_0" in rng:
        torch.cuda.set_rng_state_all([rng[f"torch_cuda_{i}"] for i in range(torch.cuda.device_count()) if f"torch_cuda_{i}" in rng])
    state = json.loads((path / "state.json").read_text())
    random.setstate(_tupled(state.pop("python_random")))
    return state
