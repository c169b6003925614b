"""`Objective`: a policy-gradient loss registered by name through ``vlmreg_register_objectives``.

``[trainer] algorithm`` names one. The loss function receives a `vlmreg.train.losses.LossInputs` for one
micro-batch (the policy's token logprobs with gradient, the old and rollout logprobs, advantages, importance
weights, and the whole step's counts) and returns ``(loss, clipped)``: a scalar already normalised so that summing it
over the step's micro-batches gives the step's loss (the normalisation lives with the formula), and a per-token bool
tensor saying which tokens the objective clipped. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from vlmreg.sdk.descriptor import _check_callable, _check_name, _fail

__all__ = ["Objective"]


def _check_clip(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    ok = isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    if not ok or not 0 < value[0] < 1 or not value[1] > 0:
        raise _fail(instance, attribute, "must be (clip_low in (0, 1), clip_high > 0)", value)


@attrs.frozen(kw_only=True, eq=False)
class Objective:
    """A loss: ``loss(inputs) -> (loss, clipped)``; ``clip`` the default ``(clip_low, clip_high)`` of its ratio."""

    name: str = attrs.field(validator=_check_name)
    loss: Callable[[Any], tuple[Any, Any]] = attrs.field(validator=_check_callable(optional=False, what="a callable taking LossInputs"))
    clip: tuple[float, float] = attrs.field(
        default=(0.2, 0.28), converter=lambda v: tuple(v) if isinstance(v, list | tuple) else v, validator=_check_clip
    )
    description: str = ""
