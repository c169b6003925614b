"""A step's record as a value, and how its numbers are reduced across data-parallel ranks.

Every rank counts its own share of a step (its rewards, tokens, clipped tokens, ...); `RankTotals` keeps each
number with how it combines over ranks (a sum, or a max), and `RankTotals.reduce` combines them all in two
collectives. Means are formed from reduced sums afterwards (``reward_mean = reward_sum / samples``), so a step's
metrics are the same however its samples were split between ranks.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from vlmreg.train.collect import RolloutBatch

__all__ = ["RankTotals", "StepRecord"]

Reduction = Literal["sum", "max"]


@attrs.frozen(eq=False)
class StepRecord:
    """What one trainer step produced: its metrics (the line of ``metrics.jsonl``) and the batch it trained on."""

    step: int
    metrics: dict[str, Any]
    batch: RolloutBatch


class RankTotals:
    """Named per-rank numbers, each with its reduction across ranks. Every rank must add the same names."""

    def __init__(self) -> None:
        self._values: dict[str, tuple[Reduction, float]] = {}

    def add(self, name: str, value: float, how: Reduction = "sum") -> None:
        if name in self._values:
            previous_how, previous = self._values[name]
            if previous_how != how:
                raise ValueError(f"metric {name!r} added as {previous_how} and as {how}")
            value = previous + value if how == "sum" else max(previous, value)
        self._values[name] = (how, float(value))

    def update(self, values: dict[str, float], how: Reduction = "sum") -> None:
        for name, value in values.items():
            self.add(name, value, how)

    def reduce(self, ctx: Any = None) -> dict[str, float]:
        """Every number combined over the ranks of ``ctx`` (a `vlmreg.train.distributed.Distributed`; ``None``: one
        process, the numbers as they are)."""
        out = {name: value for name, (_, value) in self._values.items()}
        if ctx is None:
            return out
        for how in ("sum", "max"):
            names = sorted(name for name, (kind, _) in self._values.items() if kind == how)
            if names:
                combined = ctx.sum([out[n] for n in names]) if how == "sum" else ctx.max_many([out[n] for n in names])
                out.update(zip(names, combined, strict=True))
        return out
