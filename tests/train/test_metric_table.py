"""The metrics table: one rule per name for how a step's pieces combine (micro-batches, ranks, updates)."""

from __future__ import annotations

import pytest
import torch

from vlmreg.train.metric_table import reduction
from vlmreg.train.record import RankTotals
from vlmreg.train.step import DeviceSums, average_updates


class OtherRank:
    """A second data-parallel rank, with the collectives `RankTotals.reduce` calls: its own values, given by name."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values
        self.calls: list[tuple[str, list[float]]] = []

    def _theirs(self, mine: list[float], how: str) -> list[float]:
        self.calls.append((how, mine))
        names = sorted(n for n in self.values if reduction(n) == how)
        return [self.values[n] for n in names]

    def sum(self, mine: list[float]) -> list[float]:
        return [a + b for a, b in zip(mine, self._theirs(mine, "sum"), strict=True)]

    def max_many(self, mine: list[float]) -> list[float]:
        return [max(a, b) for a, b in zip(mine, self._theirs(mine, "max"), strict=True)]


def test_ranks_combine_as_the_table_says():
    mine = RankTotals()
    mine.update({"reward_sum": 3.0, "episodes": 8, "env_length": 10.0, "server_0": 5})
    mine.add("off_policy_max", 1)
    mine.add("reward_sum", 1.0)  # a second piece on the same rank: added
    mine.add("off_policy_max", 0)  # kept the largest
    other = OtherRank({"reward_sum": 2.5, "episodes": 8, "env_length": 4.0, "server_0": 3, "off_policy_max": 2})
    assert mine.reduce(other) == {
        "reward_sum": 6.5,
        "episodes": 16,
        "env_length": 14.0,
        "server_0": 8,
        "off_policy_max": 2,
    }
    assert [how for how, _ in other.calls] == ["sum", "max"]  # two collectives, however many names
    assert mine.reduce(None)["off_policy_max"] == 1  # one process: its own numbers


def test_a_name_missing_from_the_table_is_an_error_naming_it():
    with pytest.raises(ValueError, match="'rewards_sum' is not in the metrics table"):
        RankTotals().add("rewards_sum", 1.0)


def test_micro_batch_pieces_sum_and_the_largest_weight_is_kept():
    sums = DeviceSums()
    sums.add("tis_weight", torch.tensor([1.0, 0.5]))
    sums.add("tis_weight_max", torch.tensor([1.0, 0.5]))
    sums.add("tis_weight", torch.tensor([2.0]))
    sums.add("tis_weight_max", torch.tensor([2.0]))
    sums.add("tis_weight_max", torch.tensor([]))  # a micro-batch with no loss tokens changes nothing
    assert sums.result() == {"tis_weight_max": 2.0, "tis_weight": 3.5}
    assert DeviceSums().result() == {"tis_weight_max": 0.0}


def test_updates_of_one_batch_average_except_the_maximum_and_the_count():
    first = {"loss": 1.0, "clip_fraction": 0.5, "tis_weight_max": 3.0, "loss_tokens": 40.0, "grad_norm": 2.0}
    second = {"loss": 2.0, "clip_fraction": 0.25, "tis_weight_max": 1.5, "loss_tokens": 40.0, "grad_norm": 4.0}
    merged = average_updates([first, second])
    assert merged == {
        "loss": 1.5,
        "clip_fraction": 0.375,
        "tis_weight_max": 3.0,
        "loss_tokens": 40.0,
        "grad_norm": 3.0,
        "clip_fraction_last": 0.25,
    }
    assert average_updates([first]) == first
