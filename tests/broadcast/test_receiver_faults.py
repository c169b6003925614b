"""A receiver pointed at the wrong port fails within its timeout; a receiver that gives up tells the sender at once;
joining the process group is bounded too: a peer that never joins it is an error naming the address within the timeout.

Each receiver runs in a spawned process (real gloo groups, real TCPStores), so one that hangs is killed by the test
instead of hanging it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import threading
import time
import time as clock
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import vlmreg
from vlmreg.broadcast import BroadcastError, Receiver, Sender
from vlmreg.broadcast import group as group_module
from vlmreg.broadcast.group import KEY as _KEY
from vlmreg.broadcast.group import scoped as _scoped
from vlmreg.cli import main
from vlmreg.testing import tiny_model

from .workers import wait_for

TIMEOUT_S = 3.0
SPAWN = multiprocessing.get_context("spawn")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def connect_main(port: int, timeout_s: float, result: str) -> None:
    """Child: construct a Receiver and write what happened (the error and how long it took) to ``result``."""

    started = time.monotonic()
    try:
        Receiver(None, host="127.0.0.1", port=port, rank=1, timeout_s=timeout_s, token="any")
        outcome = {"error": None}
    except BroadcastError as exc:
        outcome = {"error": str(exc), "type": type(exc).__name__}
    outcome["elapsed"] = time.monotonic() - started
    Path(result).write_text(json.dumps(outcome))


def _connect_in_child(port: int, tmp_path: Path, timeout_s: float = TIMEOUT_S) -> dict:
    result = tmp_path / "result.json"
    child = SPAWN.Process(target=connect_main, args=(port, timeout_s, str(result)), daemon=True)
    child.start()
    child.join(timeout=timeout_s + 60)  # the spawn and torch's import take a while; the Receiver must not
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"Receiver(timeout_s={timeout_s}) at a wrong port had not returned after {timeout_s + 60} s")
    return json.loads(result.read_text())


@pytest.fixture
def listener(request: pytest.FixtureRequest) -> Iterator[int]:
    """A port where something that is not a vlmreg sender listens: it accepts and never answers, or never accepts."""
    server = socket.create_server(("127.0.0.1", 0), backlog=8)
    accepted: list[socket.socket] = []
    if request.param == "accepts":

        def accept() -> None:
            try:
                while True:
                    accepted.append(server.accept()[0])
            except OSError:
                pass

        threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for conn in accepted:
        conn.close()


def test_a_receiver_at_a_port_where_nothing_listens_fails_at_once(tmp_path):
    port = _free_port()
    outcome = _connect_in_child(port, tmp_path, timeout_s=5.0)
    assert outcome["type"] == "BroadcastError"
    assert outcome["error"].startswith(f"receiver rank 1: cannot connect to a weight sender at 127.0.0.1:{port} (")
    assert outcome["elapsed"] < 5.0 + 1


@pytest.mark.parametrize("listener", ["accepts", "never-accepts"], indirect=True)
def test_a_receiver_at_a_port_where_something_else_listens_fails_within_its_timeout(listener, tmp_path):
    outcome = _connect_in_child(listener, tmp_path)
    assert outcome["type"] == "BroadcastError"
    assert outcome["error"] == (
        f"receiver rank 1: no weight sender answered at 127.0.0.1:{listener} within {TIMEOUT_S:g} s "
        "(something listens there, but it is not a vlmreg weight sender with this token (VLMREG_WEIGHTS_TOKEN or "
        "token= must be the sender's), or it is stalled)"
    )
    assert TIMEOUT_S - 0.5 < outcome["elapsed"] < TIMEOUT_S + 1


def abort_main(port: int, how: str, directory: str, token: str) -> None:
    """Child: join the sender, then fail locally before the first receive (``abort`` or leaving a ``with`` block)."""

    tmp = Path(directory)
    receiver = Receiver(None, host="127.0.0.1", port=port, rank=1, timeout_s=60, token=token)
    (tmp / "joined").touch()
    if how == "abort":
        receiver.abort("the engine ran out of memory loading the model")
        try:
            receiver.receive(timeout_s=1)
        except BroadcastError as exc:
            (tmp / "receive-after-abort").write_text(str(exc))
    else:
        try:
            with receiver:
                raise RuntimeError("the engine ran out of memory loading the model")
        except RuntimeError:
            pass
    (tmp / "done").touch()


@pytest.mark.parametrize("how", ["abort", "with"])
def test_a_receiver_that_gives_up_makes_the_sender_fail_at_once_with_its_reason(tmp_path, how):
    sender = Sender(vlmreg.resolve(tiny_model("qwen3_vl")), num_receivers=1, timeout_s=60)
    child = SPAWN.Process(target=abort_main, args=(sender.port, how, str(tmp_path), sender.token), daemon=True)
    child.start()
    try:
        sender.connect(timeout_s=90)
        wait_for(tmp_path / "done", timeout_s=60)
        started = time.monotonic()
        with pytest.raises(BroadcastError) as failure:
            sender.send(step=1)
        assert time.monotonic() - started < 2  # not the sender's 60 s timeout
        reason = "the engine ran out of memory loading the model"
        if how == "with":
            reason = f"RuntimeError: {reason}"
        assert str(failure.value) == (
            f"receiver rank 1 (host {socket.gethostname()}, pid {child.pid}) gave up before sync 1 (step 1): {reason}; "
            "no weights were sent"
        )
        with pytest.raises(BroadcastError, match="this sender is unusable"):
            sender.send(step=2)
        if how == "abort":
            assert (tmp_path / "receive-after-abort").read_text() == (
                "receiver rank 1 was aborted (the engine ran out of memory loading the model); create a new one"
            )
    finally:
        sender.close()
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def never_connected_main(port: int, token: str, timeout_s: float, result: str) -> None:
    """Child: join a sender whose trainer never calls ``connect`` (so never builds its side of the gloo group)."""

    started = time.monotonic()
    try:
        Receiver(None, host="127.0.0.1", port=port, rank=1, timeout_s=timeout_s, token=token)
        outcome = {"error": None}
    except BroadcastError as exc:
        outcome = {"error": str(exc), "type": type(exc).__name__}
    outcome["elapsed"] = time.monotonic() - started
    Path(result).write_text(json.dumps(outcome))


def test_a_receiver_whose_sender_never_builds_the_group_fails_within_its_timeout_naming_the_address(tmp_path):
    sender = Sender(vlmreg.resolve(tiny_model("qwen3_vl")), num_receivers=1, timeout_s=60)
    result = tmp_path / "result.json"
    child = SPAWN.Process(
        target=never_connected_main, args=(sender.port, sender.token, TIMEOUT_S, str(result)), daemon=True
    )
    child.start()
    try:
        child.join(timeout=TIMEOUT_S + 60)
        assert not child.is_alive(), f"Receiver(timeout_s={TIMEOUT_S}) had not returned after {TIMEOUT_S + 60} s"
        outcome = json.loads(result.read_text())
        expected = (
            f"receiver rank 1: the weight sender at 127.0.0.1:{sender.port} did not start the gloo process group "
            f"within {TIMEOUT_S:g} s (it never called connect(), or it is stalled or gone)"
        )
        assert outcome["type"] == "BroadcastError" and outcome["error"] == expected
        # the whole join, store and group, within the timeout
        assert TIMEOUT_S - 0.5 < outcome["elapsed"] < TIMEOUT_S + 1
        started = time.monotonic()  # the trainer that connects late hears why at once, not after its own 60 s
        with pytest.raises(
            BroadcastError,
            match=r"receiver rank 1 \(host .*, pid \d+\) gave up while connecting: .*did not start the gloo",
        ):
            sender.connect(timeout_s=30)
        assert time.monotonic() - started < 2
    finally:
        sender.close()
        if child.is_alive():
            child.kill()
            child.join()


def hello_only_main(port: int, token: str, directory: str) -> None:
    """Child: say hello to the sender as receiver rank 1 would, then never join the gloo group (a receiver that hangs
    or dies while joining)."""

    store = _scoped(dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30)), token)
    store.set(f"{_KEY}hello/1", json.dumps({"rank": 1, "host": socket.gethostname(), "pid": os.getpid()}))
    (Path(directory) / "hello").touch()
    time.sleep(60)


def test_a_sender_whose_receiver_never_joins_the_group_fails_within_its_timeout_naming_the_address(tmp_path):
    sender = Sender(vlmreg.resolve(tiny_model("qwen3_vl")), num_receivers=1, timeout_s=TIMEOUT_S)
    child = SPAWN.Process(target=hello_only_main, args=(sender.port, sender.token, str(tmp_path)), daemon=True)
    child.start()
    try:
        wait_for(tmp_path / "hello", timeout_s=60)
        started = time.monotonic()
        with pytest.raises(BroadcastError) as failure:
            sender.connect(timeout_s=30)
        elapsed = time.monotonic() - started
        assert str(failure.value).startswith(
            f"the gloo weight group at 127.0.0.1:{sender.port} was not joined within {TIMEOUT_S:g} s: receiver(s) rank "
            f"1 (host {socket.gethostname()}, pid {child.pid}) said hello but did not all join the group"
        )
        assert elapsed < TIMEOUT_S + 1, elapsed
        with pytest.raises(BroadcastError, match="this sender is unusable"):
            sender.connect(timeout_s=1)
    finally:
        sender.close()
        child.kill()
        child.join()


def test_an_nccl_release_that_never_returns_is_left_behind_and_the_cli_exits(monkeypatch):
    """A communicator whose peer never lets go must not keep the trainer from exiting: it is aborted (never shut
    down, which waits on the peer), the abort is waited for a bounded time, and a CLI command then exits at once with
    its code instead of waiting on native teardown."""

    class Communicator:
        def __init__(self, stuck: bool) -> None:
            self.calls: list[str] = []
            self.release = threading.Event()
            if not stuck:
                self.release.set()

        def shutdown(self) -> None:
            self.calls.append("shutdown")

        def abort(self) -> None:
            self.calls.append("abort")
            self.release.wait(30)

    quick = Communicator(stuck=False)
    group_module.shutdown_group(quick, "nccl", timeout_s=5)
    assert quick.calls == ["abort"] and not group_module.teardown_pending()
    group_module.shutdown_group(Communicator(stuck=False), "gloo")  # gloo: nothing to release
    stuck = Communicator(stuck=True)
    started = clock.monotonic()
    group_module.shutdown_group(stuck, "nccl", timeout_s=0.5)
    assert clock.monotonic() - started < 5 and stuck.calls == ["abort"]
    assert group_module.teardown_pending()
    exits: list[int] = []
    monkeypatch.setattr("os._exit", exits.append)
    main(["families", "--json"])
    assert exits == [0]
    stuck.release.set()
    for thread in group_module._STUCK:
        thread.join(5)
    assert not group_module.teardown_pending()
