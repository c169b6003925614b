"""The metrics table: every number a trainer step counts, by name, with how it combines.

A step's numbers are counted in pieces (per micro-batch, per rank, per update of one batch) and combined: ``"sum"``
adds the pieces, ``"max"`` keeps the largest. The same rule holds at every level: the policy update's running sums
over micro-batches (`vlmreg.train.step.policy_update`), the reduction over data-parallel ranks
(`vlmreg.train.record.RankTotals`) and the merge of several updates of one batch (`vlmreg.train.step.average_updates`,
where a sum, by then a per-token mean, is averaged and a max stays the largest). Means are formed from the combined
sums afterwards (`vlmreg.train.step.summarise`, `vlmreg.train.record.step_metrics`).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["PREFIXES", "REDUCTIONS", "Reduction", "reduction"]

Reduction = Literal["sum", "max"]

REDUCTIONS: dict[str, Reduction] = {
    # the policy update's per-token sums (made per-token means by `summarise`)
    "loss": "sum",
    "entropy": "sum",
    "clipped": "sum",
    "mismatch_kl": "sum",
    "tis_weight": "sum",
    "kl_ref": "sum",
    "tis_masked": "sum",
    "tis_weight_max": "max",
    # the step's episodes and training samples (`batch_totals`; made per-episode means or counts by `step_metrics`)
    "reward_sum": "sum",
    "reward_sq": "sum",
    "episodes": "sum",
    "length_sum": "sum",
    "truncated": "sum",
    "thinking_forced": "sum",
    "images_dropped": "sum",
    "videos_dropped": "sum",
    "over_budget": "sum",
    "budget_splits": "sum",
    "update_tokens": "sum",
    "masked": "sum",
    "merged": "sum",
    "breaks": "sum",
    "cut": "sum",
    "dropped": "sum",
    "off_policy_sum": "sum",
    "off_policy_max": "max",
}

PREFIXES: dict[str, Reduction] = {
    "env_": "sum",  # what environments report per episode (``env_<info key>``)
    "server_": "sum",  # completions per rollout server (``server_<index>``)
}


def reduction(name: str) -> Reduction:
    """How the metric ``name`` combines; a name the table lacks is an error (every rank must reduce alike)."""
    if name in REDUCTIONS:
        return REDUCTIONS[name]
    for prefix, how in PREFIXES.items():
        if name.startswith(prefix):
            return how
    raise ValueError(
        f"metric {name!r} is not in the metrics table (vlmreg.train.metric_table.REDUCTIONS); add it there with its "
        "reduction"
    )
