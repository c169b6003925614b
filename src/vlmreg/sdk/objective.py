"""`Objective`: a policy-gradient loss registered by name through ``vlmreg_register_objectives``.

``[trainer] algorithm`` names one. The loss function receives a `vlmreg.train.losses.LossInputs` for one
micro-batch (the policy's token logprobs with gradient, the old and rollout logprobs, advantages, importance
weights, the whole step's counts, and the loss aggregation the run chose) and returns ``(loss, clipped)``: a scalar
already normalised so that summing it over the step's micro-batches gives the step's loss (the normalisation lives
with the formula), and a per-token bool tensor saying which tokens the objective clipped. Nothing here imports torch.

An objective that declares an ``aggregation`` computes per-token terms and reduces them with
`vlmreg.train.losses.aggregate`, so ``[trainer] loss_aggregation`` can change how; one that declares none
normalises its loss itself, and ``loss_aggregation`` is refused for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from vlmreg.sdk.descriptor import _check_callable, _check_name, _fail

__all__ = ["AGGREGATIONS", "TIS_LEVELS", "Objective"]

#: How per-token loss terms become the step's loss (the names verl's ``loss_agg_mode`` uses), over the step's
#: samples i with |y_i| loss tokens each: ``token-mean`` sum_i sum_t / sum_i |y_i| (DAPO); ``seq-mean-token-mean``
#: mean_i (sum_t / |y_i|) (DeepSeekMath's GRPO, GSPO, SAPO); ``seq-mean-token-sum`` mean_i sum_t;
#: ``seq-mean-token-sum-norm`` mean_i sum_t / max_tokens, a constant (Dr. GRPO).
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: The levels of the truncated importance weight (`vlmreg.train.losses.tis_weights`).
TIS_LEVELS = ("token", "sequence", "geometric")


def _check_clip(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    ok = isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    if not ok or not 0 < value[0] <= 1 or not value[1] > 0:
        raise _fail(instance, attribute, "must be (clip_low in (0, 1], clip_high > 0); clip_low = 1: no lower bound", value)


def _one_of(choices: tuple[str, ...], *, optional: bool = False):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if optional and value is None:
            return
        if value not in choices:
            allowed = ", ".join(repr(c) for c in choices) + (" or None" if optional else "")
            raise _fail(instance, attribute, f"must be one of {allowed}", value)

    return check


@attrs.frozen(kw_only=True, eq=False)
class Objective:
    """A loss: ``loss(inputs) -> (loss, clipped)``; ``clip`` the default ``(clip_low, clip_high)`` of its ratio;
    ``aggregation`` the default reduction of its per-token terms (None: it normalises itself); ``tis_level`` the
    default level of its importance weights."""

    name: str = attrs.field(validator=_check_name)
    loss: Callable[[Any], tuple[Any, Any]] = attrs.field(validator=_check_callable(optional=False, what="a callable taking LossInputs"))
    clip: tuple[float, float] = attrs.field(
        default=(0.2, 0.28), converter=lambda v: tuple(v) if isinstance(v, list | tuple) else v, validator=_check_clip
    )
    aggregation: str | None = attrs.field(default=None, validator=_one_of(AGGREGATIONS, optional=True))
    tis_level: str = attrs.field(default="token", validator=_one_of(TIS_LEVELS))
    description: str = ""
