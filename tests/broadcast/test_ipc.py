"""CUDA IPC syncs between two processes on one GPU (skipped without CUDA); the message checks run everywhere."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch

import vlmreg
from tests.broadcast.test_copy_plan import FusedModel, checkpoint, reference, refill
from vlmreg.broadcast import BroadcastError, WeightPlan
from vlmreg.broadcast.copy_plan import PushedPlan
from vlmreg.broadcast.ipc import IpcReceiver, IpcSender, describe, gpu_uuid, open_tensor
from vlmreg.config import parse_config
from vlmreg.inference.vllm_worker import WeightIntake

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")


def _engine(inbox, outbox) -> None:
    """Another process: open each message, answer with every tensor's float64 sum, copy-free."""

    receiver = IpcReceiver(0)
    while (text := inbox.get()) is not None:
        try:
            sums = {name: float(t.double().sum()) for name, t in receiver.open(json.loads(text))}
            torch.cuda.synchronize()
            outbox.put(("ok", sums))
        except BroadcastError as exc:
            outbox.put(("error", str(exc)))


def _model():
    return vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl_moe"}, "trainer": {"device": "cuda"}})
    )


@cuda
def test_another_process_reads_the_trainers_weights_in_place_every_sync():
    loaded = _model()
    sender = IpcSender(loaded.resolved, loaded.device)
    context = mp.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    engine = context.Process(target=_engine, args=(inbox, outbox))
    engine.start()
    try:
        for step in range(3):
            with torch.no_grad():
                loaded.resolved.lm_head.weight.add_(1.0)
                loaded.model.model.language_model.layers[0].mlp.experts.gate_up_proj.mul_(2.0)
            message = sender.share(step, full=step == 0)
            # the parameters stay where they were: from the second step sync on, the message names the last one
            assert ("reuse" in message) == (step == 2) and ("tensors" in message) == (step < 2)
            inbox.put(json.dumps(message))
            status, sums = outbox.get(timeout=120)
            sender.release()
            assert status == "ok", sums
            kind = "full" if step == 0 else "step"
            expected = {
                n: float(t.double().sum())
                for n, t in WeightPlan.from_resolved(loaded.resolved, include_frozen_vision=kind == "full").tensors()
            }
            assert sums.keys() == expected.keys()
            for name, value in expected.items():
                assert sums[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name
        bad = sender.share(9)
        bad["gpu"] = "GPU-00000000-0000-0000-0000-000000000000"
        inbox.put(json.dumps(bad))
        status, text = outbox.get(timeout=60)
        sender.release()
        assert status == "error" and "needs both on one GPU" in text
        with pytest.raises(BroadcastError, match="reuses the tensors of sync"):
            list(IpcReceiver(0).open(sender.share(10)))
        sender.release()
    finally:
        inbox.put(None)
        engine.join(60)


@cuda
def test_a_malformed_message_is_refused_naming_the_tensor():
    loaded = _model()
    message = IpcSender(loaded.resolved, loaded.device).share(0)
    message["tensors"][0]["handle"] = "not base64!"
    with pytest.raises(BroadcastError, match=message["tensors"][0]["name"]):
        list(IpcReceiver(0).open(message))
    with pytest.raises(BroadcastError, match="version"):
        list(IpcReceiver(0).open({"version": 99}))


def _pushed_engine(inbox, outbox) -> None:
    """A vLLM-style worker in another process: fused weights loaded through `WeightIntake` (CUDA IPC receiver, copy
    plans), its plan exported when asked, its state sent back when asked."""

    model = FusedModel(1, 2).cuda()
    intake = WeightIntake(0, torch.device("cuda", 0), model)
    intake.init({"transport": "ipc", "timeout_s": 30, "info": {}})
    while (request := inbox.get()) is not None:
        kind, body = request
        if kind == "sync":
            outbox.put(intake.receive(body, model.load_weights))
        elif kind == "export":
            outbox.put(json.dumps(intake.export_plan(body)))
        else:
            torch.cuda.synchronize()
            outbox.put({k: v.cpu() for k, v in model.state_dict().items()})


@cuda
def test_the_trainer_pushes_syncs_into_the_engine_s_weights_with_its_exported_plan():
    pairs = [(name, t.cuda()) for name, t in checkpoint(0)]  # the trainer's weights, which stay where they are
    message = {
        "version": 1,
        "gpu": gpu_uuid(0),
        "id": "sync-a",
        "tensors": [{"name": n, **describe(t)} for n, t in pairs],
    }
    context = mp.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    engine = context.Process(target=_pushed_engine, args=(inbox, outbox))
    engine.start()
    try:
        for step in range(3):  # loaded, recorded, replayed: through the worker
            refill(pairs, step)
            torch.cuda.synchronize()
            body = {"version": 1, "gpu": message["gpu"], "reuse": "sync-a"} if step else message
            inbox.put(("sync", {"step": step, "fields": {"ipc": body}}))
            assert outbox.get(timeout=120) == len(pairs)
        inbox.put(("export", 1))
        assert "not step 1" in json.loads(outbox.get(timeout=60))["reason"]
        inbox.put(("export", 2))
        answer = json.loads(outbox.get(timeout=60))
        assert answer["plan"]["gpu"] == gpu_uuid(0) and answer["plan"]["copies"]
        pushed = PushedPlan(answer["plan"], [t for _, t in pairs], lambda entry: open_tensor(entry, 0)[0])
        for step in range(3, 6):  # the trainer writes the engine's weights itself; the engine is not asked
            refill(pairs, step)
            pushed.replay()
            torch.cuda.synchronize()
            inbox.put(("state", None))
            state = outbox.get(timeout=60)
            expected = reference([(n, t.cpu()) for n, t in pairs], rank=1, world=2)
            for name, value in expected.items():
                assert torch.equal(state[name], value), (step, name)
    finally:
        inbox.put(None)
        engine.join(60)


def test_ipc_needs_the_trainer_on_a_gpu():
    loaded = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}})
    )
    with pytest.raises(BroadcastError, match="not a GPU"):
        IpcSender(loaded.resolved, loaded.device)
