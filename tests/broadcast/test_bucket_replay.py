"""Copy plans replayed bucket by bucket as a sync arrives: the copies each bucket completes, checked against the
engine's own loader on fresh values, and, over a real gloo group in two processes, a vLLM worker's copies of an early
bucket
made before the trainer has even sent a later one."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import vlmreg
from vlmreg.broadcast import Layout, Sender, WeightPlan, apply_weights
from vlmreg.broadcast import transport as transport_module
from vlmreg.broadcast.bucket_replay import BucketReplay, bucket_of
from vlmreg.broadcast.copy_plan import PlannedLoads, PlanRefused
from vlmreg.broadcast.receiver import staged_ranges
from vlmreg.inference.vllm_worker import VlmregWorkerExtension
from vlmreg.loading.build import build_model
from vlmreg.sdk.registry import get_registry

from .helpers import assert_state_equal
from .test_copy_plan import FusedModel, checkpoint, reference, refill

# -- one process: the copies each bucket completes ---------------------------------------------------------------------


def staging(pairs, bucket_bytes: int):
    """Staging buffers as a `Receiver` keeps them for these tensors' layout: the tensors as views into them, and the
    bucket views."""
    layout = Layout.build(pairs, bucket_bytes)
    regions = [torch.empty(r.nbytes, dtype=torch.uint8) for r in layout.regions]
    views = layout.region_views(regions)
    return layout, [(name, views[name]) for name, _ in pairs], layout.bucket_views(regions)


def test_each_bucket_replays_the_copies_it_completes_and_together_they_are_the_loader():
    """Buckets of 512 bytes cut the fused model's tensors (a tensor spans up to three): after bucket ``k`` is replayed
    with every later bucket still garbage (NaN), no parameter holds a NaN (no copy read a bucket not yet in), and every
    tensor that ends in buckets ``0..k`` is already where the loader itself puts it; all buckets give the loader's
    result."""
    pairs = checkpoint(0)
    layout, staged, buckets = staging(pairs, 512)
    assert len(buckets) >= 6
    spanning = [s.name for s in layout.tensors if s.offset // 512 != (s.offset + s.nbytes - 1) // 512]
    assert spanning  # the case that matters: a copy whose source starts in one bucket and ends in another
    refill(staged, 1)
    model, loads = FusedModel(1, 2), PlannedLoads()
    for _ in range(2):  # seen, then recorded
        loads.load(model, model.load_weights, staged)
    plan = loads.plan_for(model, staged)
    assert plan is not None and loads.last == "recorded"
    replay = BucketReplay(plan, staged_ranges(buckets))
    assert sum(replay.counts) == len(plan.copies)

    refill(staged, 5)  # the next sync's values, in the same staging memory
    expected = reference(staged, rank=1, world=2)
    arrived = [bucket.clone() for bucket in buckets]
    ends = {s.name: (s.offset + s.nbytes - 1) // 512 for s in layout.tensors}
    fresh = FusedModel(1, 2)  # the engine before this sync: zeros, a padded embedding of ones
    for k in range(len(buckets)):
        for later in buckets[k + 1 :]:
            later.view(torch.float32).fill_(float("nan"))
        buckets[k].copy_(arrived[k])
        replay.run(k)
        assert not any(torch.isnan(p).any() for p in model.parameters()), k
        for name, end in ends.items():
            if end <= k:
                short = name.rsplit(".", 2)[-2]
                if short == "norm":
                    assert torch.equal(model.norm, expected["norm"])
                if short == "embed_tokens":
                    assert torch.equal(model.embed, expected["embed"])
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert not torch.equal(fresh.qkv, model.qkv)


def test_a_source_outside_the_buckets_is_refused():
    pairs = checkpoint(0)
    _, staged, buckets = staging(pairs, 1024)
    model, loads = FusedModel(), PlannedLoads()
    for _ in range(2):
        loads.load(model, model.load_weights, staged)
    plan = loads.plan_for(model, staged)
    with pytest.raises(PlanRefused, match="outside the sync's buckets"):
        BucketReplay(plan, staged_ranges(buckets[:-1]))  # the last bucket's bytes are in no range
    assert bucket_of(staged[0][1], staged_ranges(buckets)) == 0


# -- two processes over gloo: copies behind the receive
# ------------------------------------------------------------------

VOCAB = 8192  # a tiny Qwen3-VL with an embedding of 2 MiB: with 1 MiB buckets, the step sync is 5 buckets
BUCKET_MB = 1
EMBED = "model.language_model.embed_tokens.weight"
MARK = 7.0  # the embedding's value in the watched sync


def _model(seed: int):
    descriptor = get_registry().get("qwen3_vl")
    config = descriptor.tiny_config()
    config.text_config.vocab_size = VOCAB
    torch.manual_seed(seed)
    resolved = vlmreg.resolve(build_model(config, descriptor))
    connectors = {id(p) for m in resolved.connectors.values() for p in m.parameters()}
    for p in resolved.vision_encoder.parameters():  # vision frozen, connectors trained: as vlmreg.load does
        if id(p) not in connectors:
            p.requires_grad_(False)
    return resolved


class _Engine(nn.Module):
    """What vLLM's model offers the worker: its parameters and ``load_weights`` over (checkpoint name, tensor) pairs."""

    def __init__(self, resolved) -> None:
        super().__init__()
        self.model = resolved.model
        self.resolved = resolved

    def load_weights(self, weights) -> None:
        apply_weights(self.resolved, dict(weights))


def _worker(port: int, token: str, directory: str, syncs: int, queue) -> None:
    resolved = _model(seed=1)
    engine = _Engine(resolved)

    class Worker(VlmregWorkerExtension):  # vLLM mixes the extension into its worker class the same way
        def __init__(self) -> None:
            self.model_runner = SimpleNamespace(model=engine)

    embed = dict(resolved.model.named_parameters())[EMBED]

    def watch() -> None:  # says when the embedding holds the watched sync's values
        while not bool(torch.all(embed == MARK)):
            time.sleep(0.0005)
        (Path(directory) / "embedding-applied").touch()

    threading.Thread(target=watch, daemon=True).start()
    worker = Worker()
    joined = {"transport": "gloo", "timeout_s": 60, "info": {"host": "127.0.0.1", "port": port, "token": token}}
    worker.vlmreg_join_weight_group(json.dumps(joined))
    for step in range(syncs):
        worker.vlmreg_receive_weights(json.dumps({"step": step, "timeout_s": 60}))
    intake = worker._vlmreg_intake
    save_file({k: v.contiguous() for k, v in resolved.model.state_dict().items()}, f"{directory}/worker.safetensors")
    queue.put((intake.loads.last, intake._bucket_replay is not None and intake._bucket_replay[2] is not None))


def test_a_worker_copies_what_a_bucket_completes_before_the_next_bucket_is_sent(tmp_path, monkeypatch):
    """The trainer holds back bucket 2 of the fourth sync (the first the worker replays from its copy plan) until the
    worker's embedding, which bucket 1 completes, holds the new values: so the worker copied bucket 1's tensors before
    bucket 2 was even sent. Afterwards the worker's whole model is bitwise the trainer's, and it confirmed the sync
    through the weight group's store with its timings."""
    trainer = _model(seed=0)
    layout = Layout.build(WeightPlan.from_resolved(trainer, include_frozen_vision=False).shapes(), BUCKET_MB * 2**20)
    assert len(layout.buckets) >= 4 and layout.tensors[0].name == EMBED
    assert [t.name for t in layout.tensors if t.offset + t.nbytes <= 2 * 2**20] == [EMBED]  # bucket 1 completes it
    sender = Sender(trainer, num_receivers=1, backend="gloo", timeout_s=60, bucket_mb=BUCKET_MB)
    real = transport_module.broadcast
    held = {"sync": 0, "bucket": 0, "applied_before_bucket_2": None}

    def broadcast(group, tensor):
        if held["sync"] == 4:
            if held["bucket"] == 2:
                marker, deadline = tmp_path / "embedding-applied", time.monotonic() + 15
                while not marker.exists() and time.monotonic() < deadline:
                    time.sleep(0.005)
                held["applied_before_bucket_2"] = marker.exists()
            held["bucket"] += 1
        return real(group, tensor)

    monkeypatch.setattr(transport_module, "broadcast", broadcast)
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_worker, args=(sender.port, sender.token, str(tmp_path), 4, queue))
    process.start()
    try:
        sender.connect(timeout_s=90)
        parameters = [p for _, p in WeightPlan.from_resolved(trainer, include_frozen_vision=False).tensors()]
        for n in range(1, 5):  # full, then loaded, recorded, and replayed by the worker
            with torch.no_grad():
                for p in trainer.model.parameters():
                    if p.requires_grad:
                        p.add_(torch.randn_like(p))
                if n == 4:
                    dict(trainer.model.named_parameters())[EMBED].fill_(MARK)
            held["sync"] = n
            sender.send(n - 1, full=n == 1)
        deadline = time.monotonic() + 60
        while not sender.confirmed() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sender.confirmed()
        (record,) = sender.confirmations()
        last, bucketed = queue.get(timeout=60)
    finally:
        sender.close()
        process.join(30)
        if process.is_alive():
            process.kill()
    assert held["applied_before_bucket_2"] is True, "the worker copied nothing before the whole sync was in"
    assert last == "replayed" and bucketed
    assert {"wait_s", "receive_s", "copy_s", "tail_s", "total_s"} <= set(record) and record["copy_s"] > 0
    assert_state_equal(load_file(tmp_path / "worker.safetensors"), trainer.model.state_dict())
    assert parameters  # the step plan sent trainable tensors only; the frozen tower came with the first, full sync
