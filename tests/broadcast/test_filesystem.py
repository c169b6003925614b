"""Filesystem transport: atomic step directories an engine can load, and a reader that ignores partial ones."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from safetensors.torch import load_file

import vlmreg
from vlmreg.broadcast import (
    BroadcastError,
    FilesystemReader,
    FilesystemSender,
    WeightPlan,
    apply_weights,
)
from vlmreg.broadcast.filesystem import INDEX_FILE
from vlmreg.testing import tiny_model

from .helpers import assert_state_equal


def test_round_trip_is_atomic_sharded_and_loadable(tmp_path):
    model = tiny_model("qwen3_5_moe", seed=0)
    resolved = vlmreg.resolve(model)
    sender = FilesystemSender(tmp_path, resolved, shard_mb=1, keep=2)
    reader = FilesystemReader(tmp_path)
    assert reader.latest() is None and reader.poll(None) is None
    sender.write(1)
    with torch.no_grad():
        model.model.language_model.norm.weight.add_(1.0)
    path = sender.write(2)
    assert path.name == "step_000002" and (tmp_path / "latest").read_text().strip() == "step_000002"
    index = json.loads((path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((path / s).is_file() for s in shards) and (path / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    on_disk = {}
    for shard in shards:
        on_disk.update(load_file(path / shard))
    assert_state_equal(on_disk, dict(WeightPlan.from_resolved(resolved, include_frozen_vision=True).tensors()))

    step, received = reader.poll(1)
    assert step == 2 and reader.poll(2) is None
    target = vlmreg.resolve(tiny_model("qwen3_5_moe", seed=1))
    apply_weights(target, received)
    assert_state_equal(target.model.state_dict(), model.state_dict())
    with pytest.raises(BroadcastError, match="already exists"):
        sender.write(2)


def test_reader_ignores_a_partial_temp_dir_and_an_incomplete_step(tmp_path):
    sender = FilesystemSender(tmp_path, vlmreg.resolve(tiny_model("qwen3_vl")), keep=0)
    sender.write(5)
    partial = tmp_path / ".tmp-step_000007-deadbeef"  # a writer killed mid-way
    partial.mkdir()
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 10)
    incomplete = tmp_path / "step_000006"  # renamed by hand, one shard missing
    incomplete.mkdir()
    (incomplete / INDEX_FILE).write_text(
        json.dumps({"metadata": {}, "weight_map": {"x": "model-00001-of-00001.safetensors"}})
    )
    (tmp_path / "latest").write_text("step_000006\n")
    reader = FilesystemReader(tmp_path)
    assert reader.latest() == tmp_path / "step_000005"
    assert reader.load()[0] == 5


def test_lora_adapter_files_can_be_written_instead_of_merged_weights(tmp_path):
    resolved = vlmreg.resolve(tiny_model("qwen3_vl"))
    wrapped = peft.get_peft_model(
        resolved.model, peft.LoraConfig(r=2, **resolved.lora_targets("language").peft_kwargs())
    )
    path = FilesystemSender(tmp_path, vlmreg.resolve(wrapped), peft_model=wrapped, adapter=True, merged=False).write(3)
    assert (path / "adapter" / "adapter_config.json").is_file() and (
        path / "adapter" / "adapter_model.safetensors"
    ).is_file()
    assert not (path / INDEX_FILE).exists()
    assert FilesystemReader(tmp_path).latest() == path


def test_a_run_s_first_sync_rewrites_its_step_and_drops_an_earlier_timeline_s_later_steps(tmp_path):
    """A resumed run's full sync writes the step it resumes from again (the old run wrote it too), and the steps the
    old run wrote after it are not this run's: they go, so `latest` and every step left are this run's weights."""
    model = tiny_model("qwen3_5_moe", seed=0)
    resolved = vlmreg.resolve(model)
    old_run = FilesystemSender(tmp_path, resolved, keep=3)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.model.language_model.norm.weight.add_(1.0)
        old_run.write(step)
    with torch.no_grad():  # the resumed run's weights at step 1 (another timeline: they differ from the old step 1's)
        model.model.language_model.norm.weight.sub_(10.0)
    resumed = FilesystemSender(tmp_path, resolved, keep=3)
    path = resumed.write(1, replace=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]
    assert (tmp_path / "latest").read_text().strip() == "step_000001"
    on_disk = {}
    for shard in set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()):
        on_disk.update(load_file(path / shard))
    assert_state_equal(on_disk, dict(WeightPlan.from_resolved(resolved, include_frozen_vision=True).tensors()))
    with pytest.raises(BroadcastError, match="already exists"):  # a later sync of the same step is still refused
        resumed.write(1)
