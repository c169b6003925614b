"""A step's record as a value, and how its numbers are reduced across data-parallel ranks.

Every rank counts its own share of a step (its rewards, tokens, clipped tokens, ...); `RankTotals` keeps each
number, which combines over ranks as the metrics table says (`vlmreg.train.metric_table`: a sum, or a max), and
`RankTotals.reduce` combines them all in two collectives. Means are formed from reduced sums afterwards (``reward_mean =
reward_sum / samples``), so a step's metrics are the same however its samples were split between ranks.
"""

from __future__ import annotations

from typing import Any

import attrs

from vlmreg.train.collect import RolloutBatch
from vlmreg.train.metric_table import Reduction, reduction

__all__ = ["RankTotals", "StepRecord", "batch_totals", "episode_keys", "step_metrics"]


@attrs.frozen(eq=False)
class StepRecord:
    """What one trainer step produced: its metrics (the line of ``metrics.jsonl``) and the batch it trained on."""

    step: int
    metrics: dict[str, Any]
    batch: RolloutBatch


class RankTotals:
    """Named per-rank numbers, each combined across ranks as the metrics table says. Every rank adds the same names."""

    def __init__(self) -> None:
        self._values: dict[str, tuple[Reduction, float]] = {}

    def add(self, name: str, value: float) -> None:
        how = reduction(name)
        if name in self._values:
            previous = self._values[name][1]
            value = previous + value if how == "sum" else max(previous, value)
        self._values[name] = (how, float(value))

    def update(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.add(name, value)

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


def _episode_value(value: Any) -> float:
    """An episode's ``info`` value as a number: itself, the length of a list (achievements unlocked), else 0."""
    if isinstance(value, (list, tuple)):
        return float(len(value))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def episode_keys(trajectories: list[Any], ctx: Any = None) -> list[str]:
    """The ``info`` keys of the episodes that hold a number or a list (counted), the same on every rank of ``ctx``."""
    keys = {
        k
        for t in trajectories
        for k, v in t.info.items()
        if isinstance(v, (int, float, list, tuple)) and not isinstance(v, bool)
    }
    if ctx is not None:
        keys = set().union(*ctx.gather_objects(sorted(keys)))
    return sorted(keys)


def batch_totals(batch: RolloutBatch, stats: Any, *, masked: int, update_tokens: int, keys: list[str]) -> RankTotals:
    """This rank's counts of a step: its episodes (rewards, lengths, images, staleness, ``info`` numbers under
    ``keys``) and its training samples (``stats``: `vlmreg.train.samples.SampleStats`)."""
    step, trajectories = batch.step, batch.trajectories
    rewards = [t.reward for t in trajectories]
    totals = RankTotals()
    totals.update(
        {
            "reward_sum": sum(rewards),
            "reward_sq": sum(r * r for r in rewards),
            "episodes": len(trajectories),
            "length_sum": sum(sum(len(turn.completion_ids) for turn in t.turns) for t in trajectories),
            "truncated": sum(t.turns[-1].finish_reason == "length" for t in trajectories if t.turns),
            "thinking_forced": sum(turn.thinking_forced for t in trajectories for turn in t.turns),
            "images_dropped": sum(t.images_dropped for t in trajectories) + stats.images_cut,
            "videos_dropped": sum(t.videos_dropped for t in trajectories),
            "over_budget": sum(t.images_over_budget for t in trajectories),
            "budget_splits": stats.budget_splits,
            "update_tokens": update_tokens,
            "masked": masked,
            "merged": stats.merged_turns,
            "breaks": stats.prefix_breaks,
            "cut": stats.truncated,
            "dropped": stats.dropped,
            "off_policy_sum": sum(step - 1 - t.policy_version for t in trajectories),
        }
    )
    totals.add("off_policy_max", max((step - 1 - t.policy_version for t in trajectories), default=0))
    for index, count in enumerate(batch.per_server):  # every rank has the same servers
        totals.add(f"server_{index}", count)
    for key in keys:  # what environments report per episode (a game's length, return, achievements)
        totals.add(f"env_{key}", sum(_episode_value(t.info.get(key)) for t in trajectories))
    return totals


def step_metrics(
    g: dict[str, float],
    batch: RolloutBatch,
    *,
    keys: list[str],
    lr: float,
    update: dict[str, float],
    samples: int,
    update_s: float,
) -> dict[str, Any]:
    """The line of ``metrics.jsonl`` from the step's totals reduced over ranks (``g``), its policy update's metrics
    (``update``) and timings; means are per episode."""
    n = max(g["episodes"], 1.0)
    mean = g["reward_sum"] / n
    return {
        "step": batch.step,
        "reward_mean": mean,
        "reward_std": max(g["reward_sq"] / n - mean * mean, 0.0) ** 0.5,
        "response_length": g["length_sum"] / n,
        "truncated_responses": int(g["truncated"]),
        "thinking_budget_hits": int(g["thinking_forced"]),
        "lr": lr,
        **update,
        "samples": samples,
        "turns_merged": int(g["merged"]),
        "prefix_breaks": int(g["breaks"]),
        "samples_truncated": int(g["cut"]),
        "samples_dropped": int(g["dropped"]),
        "samples_masked_truncated": int(g["masked"]),
        "images_dropped": int(g["images_dropped"]),
        "images_over_budget": int(g["over_budget"]),
        "videos_dropped": int(g["videos_dropped"]),
        "samples_split_by_budget": int(g["budget_splits"]),
        "update_tokens": int(g["update_tokens"]),
        "tokens_per_s": g["update_tokens"] / update_s if update_s > 0 else 0.0,
        "policy_version": batch.policy_version,
        "off_policy_steps_mean": g["off_policy_sum"] / n,
        "off_policy_steps_max": int(g["off_policy_max"]),
        "rollout_s": batch.rollout_s,
        "update_s": update_s,
        **{f"env_{key}": g[f"env_{key}"] / n for key in keys},
        **(
            {"rollout_completions_per_server": [int(g[f"server_{k}"]) for k in range(len(batch.per_server))]}
            if batch.per_server
            else {}
        ),
    }
