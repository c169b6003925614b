"""CUDA IPC syncs between two processes on one GPU (skipped without CUDA); the message checks run everywhere."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch

from vlmreg.broadcast import BroadcastError, WeightPlan

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")


def _engine(inbox, outbox) -> None:
    """Another process: open each message, answer with every tensor's float64 sum, copy-free."""
    from vlmreg.broadcast.ipc import IpcReceiver

    receiver = IpcReceiver(0)
    while (text := inbox.get()) is not None:
        try:
            sums = {name: float(t.double().sum()) for name, t in receiver.open(json.loads(text))}
            torch.cuda.synchronize()
            outbox.put(("ok", sums))
        except BroadcastError as exc:
            outbox.put(("error", str(exc)))


def _model():
    import vlmreg
    from vlmreg.config import parse_config

    return vlmreg.load(parse_config({"model": {"init": "random", "family": "qwen3_vl_moe"}, "trainer": {"device": "cuda"}}))


@cuda
def test_another_process_reads_the_trainers_weights_in_place_every_sync():
    from vlmreg.broadcast.ipc import IpcReceiver, IpcSender

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
            expected = {n: float(t.double().sum()) for n, t in WeightPlan.from_resolved(loaded.resolved, include_frozen_vision=kind == "full").tensors()}
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
    from vlmreg.broadcast.ipc import IpcReceiver, IpcSender

    loaded = _model()
    message = IpcSender(loaded.resolved, loaded.device).share(0)
    message["tensors"][0]["handle"] = "not base64!"
    with pytest.raises(BroadcastError, match=message["tensors"][0]["name"]):
        list(IpcReceiver(0).open(message))
    with pytest.raises(BroadcastError, match="version"):
        list(IpcReceiver(0).open({"version": 99}))


def test_ipc_needs_the_trainer_on_a_gpu():
    import vlmreg
    from vlmreg.broadcast.ipc import IpcSender
    from vlmreg.config import parse_config

    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}}))
    with pytest.raises(BroadcastError, match="not a GPU"):
        IpcSender(loaded.resolved, loaded.device)
