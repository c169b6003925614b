"""The reference policy of the KL penalty (``[trainer] kl_coef > 0``): the policy training started from."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from vlmreg.modeling.logprobs import selected_logprobs
from vlmreg.resolution import resolve

__all__ = ["reference_logprobs"]


def reference_logprobs(loaded: Any, objective: Any) -> Callable[[Any], torch.Tensor]:
    """A function giving a micro-batch's logprobs under the initial policy: the LoRA adapters switched off, or a
    frozen copy of the whole model taken now. ``objective`` (a `vlmreg.train.step.LossSettings`) gives the sampling
    temperature and the suppressed tokens, as for the policy's own logprobs."""
    resolved = loaded.resolved

    def logprobs(family: Any, mb: Any) -> torch.Tensor:
        return selected_logprobs(
            family,
            mb.inputs,
            mb.targets,
            mb.selection,
            temperature=objective.temperature,
            suppress=objective.suppress,
        )[0]

    if loaded.lora is not None:
        model = loaded.model

        def with_adapters_off(mb: Any) -> torch.Tensor:
            with torch.no_grad(), model.disable_adapter():
                return logprobs(resolved, mb)

        return with_adapters_off

    snapshot = copy.deepcopy(resolved.model)
    for p in snapshot.parameters():
        p.requires_grad_(False)
    frozen = resolve(snapshot, resolved.overrides, family=resolved.descriptor)

    def from_the_copy(mb: Any) -> torch.Tensor:
        with torch.no_grad():
            return logprobs(frozen, mb)

    return from_the_copy
