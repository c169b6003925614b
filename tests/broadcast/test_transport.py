"""The gloo transport with real processes: bitwise equal models after a sync, clear errors instead of hangs."""

from __future__ import annotations

import copy
import multiprocessing
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vlmreg
from vlmreg.broadcast import BroadcastError, LayoutMismatchError, Receiver, Sender
from vlmreg.loading.build import build_model
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import tiny_model

from .helpers import assert_state_equal, frozen_vision
from .workers import receiver_main, wait_for

TIMEOUT_S = 3.0


def received_state(tmp: Path, rank: int, sync: int) -> dict[str, torch.Tensor]:
    path = tmp / f"rank{rank}-sync{sync}.safetensors"
    wait_for(path)
    return load_file(path)


def test_two_receiver_processes_match_the_sender_and_a_killed_one_is_named(tmp_path):
    model = tiny_model("qwen3_vl", seed=0)
    resolved = frozen_vision(vlmreg.resolve(model))
    sender = Sender(resolved, num_receivers=2, timeout_s=TIMEOUT_S, checksum=True)
    context = multiprocessing.get_context("spawn")
    receivers = [
        context.Process(
            target=receiver_main,
            args=(rank, sender.port, str(tmp_path), "qwen3_vl", 10 + rank, sender.token),
            daemon=True,
        )
        for rank in (1, 2)
    ]
    for process in receivers:
        process.start()
    try:
        sender.connect(timeout_s=90)
        assert sender.send(step=1).kind == "full"
        for rank in (1, 2):
            assert_state_equal(received_state(tmp_path, rank, 1), model.state_dict())

        with torch.no_grad():  # an optimizer step: the language model and the trainable merger change
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p))
        (tmp_path / "go1").touch()
        stats = sender.send(step=2)
        assert stats.kind == "step" and stats.tensors < len(model.state_dict())
        for rank in (1, 2):
            assert_state_equal(received_state(tmp_path, rank, 2), model.state_dict())

        dead = receivers[1]
        dead.kill()
        dead.join()
        (tmp_path / "go2").touch()
        started = time.monotonic()
        with pytest.raises(BroadcastError) as failure:
            sender.send(step=3)
        assert time.monotonic() - started < TIMEOUT_S + 2
        assert f"rank 2 (host {socket.gethostname()}, pid {dead.pid}) was not ready for sync 3 (step 3)" in str(
            failure.value
        )
        assert "rank 1" not in str(failure.value)
    finally:
        sender.close()
        receivers[0].join(timeout=30)
        for process in receivers:
            if process.is_alive():
                process.kill()
    assert receivers[0].exitcode == 0  # it got SenderClosed, not a hang


def test_a_receiver_of_another_shape_refuses_before_anything_is_applied():
    sender = Sender(vlmreg.resolve(tiny_model("qwen3_vl")), num_receivers=1, timeout_s=30)
    descriptor = get_registry().get("qwen3_vl")
    config = descriptor.tiny_config()
    config.text_config.intermediate_size = 96
    other = vlmreg.resolve(build_model(config, descriptor))
    before = copy.deepcopy(other.model.state_dict())
    outcome: dict[str, BroadcastError] = {}

    def connect() -> None:
        try:
            sender.connect()
        except BroadcastError as exc:
            outcome["sender"] = exc

    thread = threading.Thread(target=connect)
    thread.start()
    try:
        with pytest.raises(
            LayoutMismatchError,
            match=r"'model.language_model.layers.0.mlp.gate_proj.weight': the sender sends \(128, 64\) float32, this "
            r"model has \(96, 64\) float32",
        ):
            Receiver(other, host="127.0.0.1", port=sender.port, rank=1, timeout_s=30, token=sender.token)
        thread.join(timeout=30)
    finally:
        sender.close()
    assert isinstance(outcome["sender"], LayoutMismatchError)
    assert "receiver rank 1 (host" in str(outcome["sender"]) and "mlp.gate_proj.weight" in str(outcome["sender"])
    assert_state_equal(other.model.state_dict(), before)


def test_a_receiver_that_never_connects_is_named():
    sender = Sender(vlmreg.resolve(tiny_model("qwen3_vl")), num_receivers=1, timeout_s=0.3)
    try:
        with pytest.raises(BroadcastError, match=r"receiver rank\(s\) 1 did not connect to 127.0.0.1:\d+ within 0.3 s"):
            sender.send(step=1)
    finally:
        sender.close()


def test_without_the_sender_s_token_a_receiver_finds_no_sender_and_cannot_join(monkeypatch):
    resolved = vlmreg.resolve(tiny_model("qwen3_vl"))
    monkeypatch.delenv("VLMREG_WEIGHTS_TOKEN", raising=False)
    sender = Sender(resolved, num_receivers=1, timeout_s=1.0)
    try:
        assert len(sender.token) == 32  # random when neither token= nor the environment gives one
        with pytest.raises(BroadcastError, match="no weight token"):
            Receiver(None, host="127.0.0.1", port=sender.port, rank=1, timeout_s=2)
        started = time.monotonic()
        with pytest.raises(
            BroadcastError, match=r"no weight sender (answered )?at 127.0.0.1:\d+ within 1.5 s.* with this token"
        ):
            Receiver(None, host="127.0.0.1", port=sender.port, rank=1, timeout_s=1.5, token="f" * 32)
        assert time.monotonic() - started < 5
        with pytest.raises(BroadcastError, match="did not connect .* needs this sender's token"):
            sender.connect()  # the wrong-token receiver never reached it
    finally:
        sender.close()
    monkeypatch.setenv("VLMREG_WEIGHTS_TOKEN", "shared-secret")
    shared = Sender(resolved, num_receivers=1, timeout_s=1.0)
    shared.close()
    assert shared.token == "shared-secret"


def test_a_receiver_process_that_died_is_named_at_once_by_the_senders_liveness_check(tmp_path):
    """A launched server that dies before its next sync: the sender calls ``alive`` while it waits for the receivers to
    be ready, so the death is reported at once, not after ``timeout_s`` (the trainer sets ``alive`` to its launched
    servers' check)."""
    model = tiny_model("qwen3_vl", seed=0)
    sender = Sender(frozen_vision(vlmreg.resolve(model)), num_receivers=1, timeout_s=60)
    process = multiprocessing.get_context("spawn").Process(
        target=receiver_main, args=(1, sender.port, str(tmp_path), "qwen3_vl", 11, sender.token), daemon=True
    )
    process.start()

    def alive() -> None:
        if process.exitcode is not None:
            raise VlmregError(f"the rollout server (pid {process.pid}) exited with code {process.exitcode}")

    sender.alive = alive
    try:
        sender.connect(timeout_s=90)
        sender.send(step=1)
        received_state(tmp_path, 1, 1)
        process.kill()
        process.join()
        started = time.monotonic()
        with pytest.raises(VlmregError, match=rf"pid {process.pid}\) exited with code -9"):
            sender.send(step=2)
        assert time.monotonic() - started < 5  # not the 60 s of timeout_s
        with pytest.raises(BroadcastError, match="a receiver died before sync 2"):
            sender.send(step=3)  # the sender is unusable after that, and says why
    finally:
        sender.close()
