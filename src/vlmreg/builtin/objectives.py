"""vlmreg's built-in objectives, registered through ``vlmreg_register_objectives`` like a third party's.

The formulas live in `vlmreg.train.losses`, each next to its reference; this module only names them, with the
defaults each paper uses: clip range, loss aggregation and importance-weight level. Importing it is cheap (torch
loads when a loss is first computed), since it loads with the plugins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vlmreg.sdk.hookspecs import hookimpl
from vlmreg.sdk.objective import Objective


def _lazy(name: str) -> Callable[[Any], Any]:
    def loss(inputs: Any) -> Any:
        # deferred: start-up cost (loads torch)
        from vlmreg.train import losses  # noqa: PLC0415

        return getattr(losses, name)(inputs)

    loss.__name__ = loss.__qualname__ = name
    return loss


BUILTIN = (
    Objective(
        name="grpo",
        loss=_lazy("grpo"),
        clip=(0.2, 0.28),
        aggregation="token-mean",
        description="GRPO's clipped ratio with DAPO's decoupled clip and token-mean (DAPO's, TRL's and verl's "
        "default); loss_aggregation = seq-mean-token-mean is DeepSeekMath's GRPO",
    ),
    Objective(
        name="gspo",
        loss=_lazy("gspo"),
        clip=(3e-4, 4e-4),
        aggregation="seq-mean-token-mean",
        tis_level="sequence",
        description="GSPO (Zheng et al. 2025): one ratio per sequence (geometric mean of its token ratios), mean over "
        "sequences; importance weights per sequence, as TRL",
    ),
    Objective(
        name="dr_grpo",
        loss=_lazy("dr_grpo"),
        clip=(0.2, 0.28),
        aggregation="seq-mean-token-sum-norm",
        description="Dr. GRPO (Liu et al. 2025): GRPO's terms summed per sequence over a constant "
        "(rollout.max_tokens); pair with normalize_advantage_std = false",
    ),
    Objective(
        name="cispo",
        loss=_lazy("cispo"),
        clip=(1.0, 0.28),
        aggregation="token-mean",
        description="CISPO (MiniMax-M1): the clipped importance weight is detached, so every token keeps its gradient; "
        "no lower bound (clip_low = 1), as the paper; token-mean",
    ),
    Objective(
        name="sapo",
        loss=_lazy("sapo"),
        clip=(0.2, 0.28),
        aggregation="seq-mean-token-mean",
        description="SAPO (Gao et al. 2025): a sigmoid gate instead of the hard clip (clip_low/clip_high unused); "
        "mean over sequences of token means",
    ),
)


@hookimpl
def vlmreg_register_objectives(register: Callable[[Objective], None]) -> None:
    """Register ``grpo``, ``gspo``, ``dr_grpo``, ``cispo`` and ``sapo``."""
    for objective in BUILTIN:
        register(objective)
