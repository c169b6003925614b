"""A sync that fails on the trainer's side releases the weight transfer at once (`ServerLink.sync`), so a broadcast that
a receiver will never take cannot hold the trainer, and the receivers learn that the channel is closed."""

from __future__ import annotations

import multiprocessing
import time

import pytest

import vlmreg
from vlmreg.broadcast import Sender
from vlmreg.inference.server_link import ServerLink
from vlmreg.sdk.errors import VlmregError
from vlmreg.testing import tiny_model

from ..broadcast.helpers import frozen_vision
from ..broadcast.workers import receiver_main, wait_for


def test_a_failed_sync_closes_the_sender_so_a_waiting_receiver_stops_instead_of_timing_out(tmp_path):
    resolved = frozen_vision(vlmreg.resolve(tiny_model("qwen3_vl", seed=0)))
    sender = Sender(resolved, num_receivers=1, timeout_s=30)
    receiver = multiprocessing.get_context("spawn").Process(
        target=receiver_main, args=(1, sender.port, str(tmp_path), "qwen3_vl", 11, sender.token), daemon=True
    )
    receiver.start()
    link = ServerLink.__new__(ServerLink)
    link.transport, link.ctx, link.vllm_server, link.sender = "gloo", None, None, sender

    def transfer_then_fail(step: int, *, full: bool) -> None:
        """The weights left, then the server's answer was an error (as when vLLM's worker ran out of memory)."""
        sender.send(step=step, full=full)
        raise VlmregError("the server at http://127.0.0.1:1 answered 500 to the weights of step 1")

    link._sync = transfer_then_fail  # type: ignore[method-assign]
    try:
        sender.connect(timeout_s=90)
        with pytest.raises(VlmregError, match="answered 500"):
            link.sync(1)
        wait_for(tmp_path / "rank1-sync1.safetensors")
        (tmp_path / "go1").touch()  # the receiver now waits for sync 2, which will never come
        started = time.monotonic()
        receiver.join(timeout=20)  # its own wait is 60 s: only the closed channel ends it sooner
        assert not receiver.is_alive() and receiver.exitcode == 0, "the receiver was not told the sender closed"
        assert time.monotonic() - started < 20
        with pytest.raises(Exception, match="unusable"):
            sender.send(step=2)
    finally:
        sender.close()
        if receiver.is_alive():
            receiver.kill()
