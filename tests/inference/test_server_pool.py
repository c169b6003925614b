"""`ServerPool`: each prompt group on one server, new groups to the least loaded, errors naming the server."""

from __future__ import annotations

import threading

import pytest

from vlmreg.inference.server_pool import ServerPool
from vlmreg.sdk.engine import SamplingParams
from vlmreg.sdk.errors import VlmregError


class Recorder:
    """An engine that answers each conversation with its own text, and records what it was sent."""

    def __init__(self, fail: bool = False, gate: threading.Event | None = None) -> None:
        self.calls: list[list[str]] = []
        self.fail, self.gate = fail, gate

    def chat(self, conversations, params, *, template_kwargs=None, names=None):
        self.calls.append(list(names))
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise VlmregError("no answer (connection refused)")
        return [f"turn of {c}" for c in conversations]


def test_each_group_goes_to_one_server_and_answers_come_back_in_order():
    engines = [Recorder(), Recorder()]
    pool = ServerPool(engines, ["http://a", "http://b"])
    names = ["ex1"] * 4 + ["ex2"] * 4 + ["ex3"] * 4
    turns = pool.chat([f"c{i}" for i in range(12)], SamplingParams(), names=names)
    assert turns == [f"turn of c{i}" for i in range(12)]
    # the least loaded gets the next
    assert engines[0].calls == [["ex1"] * 4 + ["ex3"] * 4] and engines[1].calls == [["ex2"] * 4]
    assert pool.completions == [8, 4]


def test_a_group_s_next_turn_goes_back_to_its_server():
    engines = [Recorder(), Recorder(), Recorder()]
    pool = ServerPool(engines, ["http://a", "http://b", "http://c"])
    pool.chat(["x"] * 6, SamplingParams(), names=["g1", "g1", "g2", "g2", "g3", "g3"])
    first = {name: k for k, e in enumerate(engines) for name in e.calls[0]}
    for e in engines:
        e.calls.clear()
    pool.chat(["x"] * 3, SamplingParams(), names=["g3", "g1", "g2"])  # the episodes still running, in another order
    assert {name: k for k, e in enumerate(engines) for call in e.calls for name in call} == first


def test_a_server_busy_with_another_call_gets_fewer_new_groups():
    gate = threading.Event()
    engines = [Recorder(gate=gate), Recorder()]
    pool = ServerPool(engines, ["http://a", "http://b"])
    pool._in_flight[0] = 8  # another call's conversations are still on server 0
    pool.chat(["x"] * 8, SamplingParams(), names=["g1"] * 4 + ["g2"] * 4)
    assert engines[0].calls == [] and engines[1].calls == [["g1"] * 4 + ["g2"] * 4]


def test_a_failing_server_is_named_in_the_error():
    pool = ServerPool([Recorder(), Recorder(fail=True)], ["http://a:1", "http://b:2"])
    with pytest.raises(VlmregError, match=r"rollout server 2 of 2 \(http://b:2\): no answer"):
        pool.chat(["x", "y"], SamplingParams(), names=["g1", "g2"])
