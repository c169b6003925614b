"""Filesystem transport: each sync is a checkpoint directory an engine can load, published atomically.

`FilesystemSender.write(step)` writes ``DIR/step_NNNNNN/``: sharded safetensors of the plan's tensors under
checkpoint names, ``model.safetensors.index.json``, the model's ``config.json`` and, optionally, peft's adapter
files in ``adapter/``. Everything is written into a hidden temp directory, fsynced and renamed into place; then
``DIR/latest`` (a one-line file naming the directory) is replaced atomically. A reader never sees a partial sync:
`FilesystemReader` only considers ``step_*`` directories whose index lists shards that all exist.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vlmreg.broadcast.errors import BroadcastError
from vlmreg.broadcast.plan import WeightPlan
from vlmreg.durable import fsync_file, fsync_tree
from vlmreg.loading.wrapped import model_class_name
from vlmreg.resolution import ResolvedFamily

__all__ = ["INDEX_FILE", "FilesystemReader", "FilesystemSender"]

INDEX_FILE = "model.safetensors.index.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class FilesystemSender:
    """Writes one loadable checkpoint directory per sync; ``keep`` newest are kept (0: all).

    ``peft_model`` (the peft wrapper) with ``adapter=True`` also writes peft's adapter files (``adapter/``), for
    engines that load LoRA adapters; ``merged=False`` writes only those. ``lora_modules``: adapter syncs (the
    shards then hold those modules' adapter factors under peft's names, and the rest merged: `WeightPlan`).
    """

    def __init__(
        self,
        directory: str | Path,
        resolved: ResolvedFamily,
        *,
        shard_mb: int = 5000,
        keep: int = 2,
        include_frozen_vision: bool = True,
        peft_model: Any = None,
        adapter: bool = False,
        merged: bool = True,
        lora_modules: frozenset[str] | None = None,
    ) -> None:
        if adapter and peft_model is None:
            raise BroadcastError("adapter=True needs peft_model, the peft-wrapped model whose adapters to write")
        if not merged and not adapter:
            raise BroadcastError("merged=False and adapter=False would write nothing")
        self.directory = Path(directory)
        self.plan = WeightPlan.from_resolved(
            resolved, include_frozen_vision=include_frozen_vision, lora_modules=lora_modules
        )
        self.model = resolved.model
        self.config = getattr(resolved.model, "config", None)
        self.shard_bytes = shard_mb * 2**20
        self.keep, self.peft_model, self.adapter, self.merged = keep, peft_model, adapter, merged
        self.written_bytes = 0  # the tensor bytes of the last `write`

    def write(self, step: int, *, replace: bool = False) -> Path:
        """Write ``step_NNNNNN`` atomically and point ``latest`` at it; returns its path.

        Each step is written once, except with ``replace`` (a run's first, full sync: a resumed run, or one started
        again in the same folder, writes the step it starts from anew). Then the step's old directory is swapped out
        only once
        the new one is complete, and steps after it, left by the run's earlier timeline, are removed: a reader must
        never take them for this run's newer weights."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"step_{step:06d}"
        if final.exists() and not replace:
            raise BroadcastError(f"{final} already exists; each step is written once")
        tmp = self.directory / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            if self.merged:
                self._write_weights(tmp)
                # naming the model's own class, whatever wraps it (`vlmreg.loading.wrapped`)
                if self.config is not None:
                    config = copy.deepcopy(self.config)
                    config.architectures = [model_class_name(self.model)]
                    config.to_json_file(tmp / "config.json")
            if self.adapter:
                self.peft_model.save_pretrained(tmp / "adapter")
            fsync_tree(tmp)
            if replace:
                self._drop_later(step)
            if final.exists():  # swapped out only now that the new one is complete
                old = self.directory / f".replaced-{final.name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        pointer = self.directory / f".latest-{uuid.uuid4().hex[:8]}"
        pointer.write_text(final.name + "\n")
        fsync_file(pointer)
        os.replace(pointer, self.directory / "latest")
        self._prune()
        return final

    def _drop_later(self, step: int) -> None:
        """Remove the step directories after ``step`` (an earlier run's, or this run's before it resumed from
        ``step``)."""
        for path in self.directory.iterdir():
            if _STEP_DIR.match(path.name) and int(path.name[5:]) > step:
                shutil.rmtree(path, ignore_errors=True)

    def _write_weights(self, target: Path) -> None:
        shards: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = total = 0
        for name, tensor in self.plan.tensors():
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > self.shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tensor))
            size += nbytes
            total += nbytes
        weight_map: dict[str, str] = {}
        for index, shard in enumerate(shards, 1):
            filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            # clone: safetensors refuses tensors that share storage (e.g. expert views of one fused tensor)
            save_file(
                {name: t.detach().to("cpu", copy=True).contiguous() for name, t in shard},
                target / filename,
                metadata={"format": "pt"},
            )
            weight_map.update({name: filename for name, _ in shard})
        self.written_bytes = total
        index_data = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (target / INDEX_FILE).write_text(json.dumps(index_data, indent=2))

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        steps = sorted((p for p in self.directory.iterdir() if _STEP_DIR.match(p.name)), key=lambda p: int(p.name[5:]))
        for old in steps[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


class FilesystemReader:
    """Finds and loads the newest complete sync in a directory written by `FilesystemSender`."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    @staticmethod
    def is_complete(path: Path) -> bool:
        """Whether ``path`` has an index whose shards all exist (adapter-only syncs: the adapter config)."""
        index = path / INDEX_FILE
        if not index.is_file():
            return (path / "adapter" / "adapter_config.json").is_file()
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError):
            return False
        return all((path / f).is_file() for f in files)

    def latest(self) -> Path | None:
        """The directory ``latest`` names if complete, else the highest complete ``step_*``; ``None`` if none."""
        pointer = self.directory / "latest"
        if pointer.is_file():
            named = self.directory / pointer.read_text().strip()
            if _STEP_DIR.match(named.name) and self.is_complete(named):
                return named
        if not self.directory.is_dir():
            return None
        steps = [p for p in self.directory.iterdir() if _STEP_DIR.match(p.name) and self.is_complete(p)]
        return max(steps, key=lambda p: int(p.name[5:]), default=None)

    def load(self, path: Path | None = None, device: str | torch.device = "cpu") -> tuple[int, dict[str, torch.Tensor]]:
        """(step, checkpoint name -> tensor) of ``path`` or of the newest complete sync; pass it to `apply_weights`."""
        path = path or self.latest()
        if path is None:
            raise BroadcastError(f"{self.directory}: no complete step_* directory yet")
        index = json.loads((path / INDEX_FILE).read_text())
        tensors: dict[str, torch.Tensor] = {}
        for filename in sorted(set(index["weight_map"].values())):
            tensors.update(load_file(path / filename, device=str(device)))
        return int(path.name[5:]), tensors

    def poll(self, after_step: int | None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest complete sync if it is newer than ``after_step``, else ``None``."""
        path = self.latest()
        if path is None or (after_step is not None and int(path.name[5:]) <= after_step):
            return None
        return self.load(path)
