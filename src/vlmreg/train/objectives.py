"""vlmreg's built-in objectives, registered through ``vlmreg_register_objectives`` like a third party's.

The formulas live in `vlmreg.train.losses`, each next to its reference; this module only names them, with their
default clip ranges. Importing it is cheap (torch loads when a loss is first computed), since it loads with the
plugins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vlmreg.sdk.hookspecs import hookimpl
from vlmreg.sdk.objective import Objective


def _lazy(name: str) -> Callable[[Any], Any]:
    def loss(inputs: Any) -> Any:
        from vlmreg.train import losses

        return getattr(losses, name)(inputs)

    loss.__name__ = loss.__qualname__ = name
    return loss


BUILTIN = (
    Objective(name="grpo", loss=_lazy("grpo"), clip=(0.2, 0.28),
              description="GRPO with DAPO's decoupled clip; token-level mean over the step's loss tokens"),
    Objective(name="gspo", loss=_lazy("gspo"), clip=(3e-4, 4e-4),
              description="GSPO: one importance ratio per sequence (geometric mean); mean over sequences"),
    Objective(name="dr_grpo", loss=_lazy("dr_grpo"), clip=(0.2, 0.28),
              description="Dr. GRPO: GRPO's surrogate over a constant (samples x max_tokens); pair with normalize_advantage_std = false"),
    Objective(name="cispo", loss=_lazy("cispo"), clip=(0.99, 0.28),
              description="CISPO: the clipped importance weight is detached, so every token keeps its gradient"),
    Objective(name="sapo", loss=_lazy("sapo"), clip=(0.2, 0.28),
              description="SAPO: a sigmoid gate instead of the hard clip (clip_low/clip_high unused); mean over sequences"),
)


@hookimpl
def vlmreg_register_objectives(register: Callable[[Objective], None]) -> None:
    """Register ``grpo``, ``gspo``, ``dr_grpo``, ``cispo`` and ``sapo``."""
    for objective in BUILTIN:
        register(objective)
