"""`AheadCollector`: batches collected ahead of training, each from the policy version its rules give.

The reference is the rule itself, written out here: batch t comes from version max(t - 1 - N, v0), and the sync of
version v starts only after batch v + N was collected. A fake `collect` records what it saw; nothing else of
vlmreg runs.
"""

from __future__ import annotations

import threading
import time

import pytest

from vlmreg.train.collect import AheadCollector, RolloutBatch


class FakeServer:
    """Holds a policy version; `collect` samples from whatever it holds, slowly; syncs change it."""

    def __init__(self, version: int, collect_s: float = 0.02) -> None:
        self.version, self.collect_s = version, collect_s
        self.events: list[tuple[str, int, int]] = []
        self.lock = threading.Lock()
        self.collecting = False

    def collect(self, step: int, version: int) -> RolloutBatch:
        assert version == self.version, "the collector's idea of the server's version is the server's"
        with self.lock:
            assert not self.collecting
            self.collecting = True
        self.events.append(("start", step, self.version))
        time.sleep(self.collect_s)
        self.events.append(("end", step, self.version))
        self.collecting = False
        return RolloutBatch(step, [], version, self.collect_s, {"taken": step})

    def sync(self, version: int) -> None:
        assert not self.collecting, "a sync never lands in the middle of a batch"
        self.events.append(("sync", version, version))
        self.version = version


def train(server: FakeServer, *, first: int, last: int, ahead: int, update_s: float = 0.01) -> list[RolloutBatch]:
    collector = AheadCollector(server.collect, first=first, last=last, ahead=ahead, version=server.version)
    batches = []
    try:
        for step in range(first, last + 1):
            batch = collector.get(step)
            batches.append(batch)
            time.sleep(update_s)  # the update, overlapping the next collection
            with collector.sync(step):
                server.sync(step)
    finally:
        collector.close()
    return batches


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_each_batch_comes_from_exactly_the_version_the_rule_gives(ahead):
    server = FakeServer(version=0)
    batches = train(server, first=1, last=8, ahead=ahead)
    assert [b.step for b in batches] == list(range(1, 9))
    assert [b.policy_version for b in batches] == [max(t - 1 - ahead, 0) for t in range(1, 9)]
    assert [b.off_policy_steps for b in batches] == [min(t - 1, ahead) for t in range(1, 9)]
    for v in range(1, 9):  # the sync of v came after batch v + N ended and before batch v + N + 1 started
        sync_at = server.events.index(("sync", v, v))
        ends = [i for i, e in enumerate(server.events) if e[0] == "end" and e[1] == min(v + ahead, 8)]
        assert ends and ends[0] < sync_at
        later = [i for i, e in enumerate(server.events) if e[0] == "start" and e[1] == v + ahead + 1]
        assert not later or later[0] > sync_at


def test_updates_overlap_collection():
    """With N = 1 a step costs about max(collect, update), not their sum."""
    server = FakeServer(version=0, collect_s=0.1)
    started = time.perf_counter()
    train(server, first=1, last=6, ahead=1, update_s=0.1)
    overlapped = time.perf_counter() - started
    assert overlapped < 6 * 0.2 * 0.8, overlapped  # synchronous would be >= 1.2 s


def test_a_resumed_run_starts_from_the_checkpoint_s_version_and_never_waits_for_an_older_one():
    server = FakeServer(version=5)
    batches = train(server, first=6, last=9, ahead=1)
    assert [b.policy_version for b in batches] == [5, 5, 6, 7]
    assert [b.off_policy_steps for b in batches] == [0, 1, 1, 1]


def test_an_error_while_collecting_reaches_the_trainer():
    def collect(step: int, version: int) -> RolloutBatch:
        if step == 3:
            raise ValueError("the reward server is down")
        return RolloutBatch(step, [], version, 0.0)

    collector = AheadCollector(collect, first=1, last=5, ahead=1, version=0)
    try:
        assert collector.get(1).step == 1
        with collector.sync(1):
            pass
        assert collector.get(2).step == 2
        with pytest.raises(ValueError, match="reward server is down"), collector.sync(2):
            pass
        with pytest.raises(ValueError, match="reward server is down"):
            collector.get(3)
    finally:
        collector.close()


def test_exclusive_holds_the_server_between_batches():
    server = FakeServer(version=0, collect_s=0.05)
    collector = AheadCollector(server.collect, first=1, last=4, ahead=2, version=0)
    try:
        collector.get(1)
        with collector.exclusive():
            assert not server.collecting
            count = len(server.events)
            time.sleep(0.15)  # nothing starts while held
            assert len(server.events) == count
    finally:
        collector.close()


def test_ahead_zero_is_the_synchronous_loop_and_not_this_class():
    with pytest.raises(ValueError, match="ahead >= 1"):
        AheadCollector(lambda step, version: RolloutBatch(step, [], version, 0.0), first=1, last=2, ahead=0, version=0)
