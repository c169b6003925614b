"""Checkpoint files reach the disk (fsync) before the rename that makes them the checkpoint, and so does `latest`."""

from __future__ import annotations

import os

import torch

from vlmreg.train import checkpoint


def test_every_file_and_the_folders_are_fsynced_before_they_count(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", recording)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    final = checkpoint.save_checkpoint(tmp_path / "checkpoints", 7, model, optimizer, {"source": {}})
    names = {os.path.basename(p) for p in synced}
    assert {"trainable.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"} <= names
    tmp_folder = next(p for p in synced if os.path.basename(p).startswith(".tmp-step_000007"))
    assert tmp_folder  # the folder itself, before its rename to step_000007
    assert ".latest.tmp" in names and str(tmp_path / "checkpoints") in synced  # the pointer and the rename of it
    assert (final / "state.json").is_file() and (tmp_path / "checkpoints" / "latest").read_text() == "step_000007"
