"""`Engine`: a rollout engine registered by name through ``vlmreg_register_rollout_engines``.

``[rollout] engine`` names one. ``build(context)`` receives a `vlmreg.train.engines.EngineContext` (the run's config,
model, processor, image store, device and family; for a server engine also the server's URL and API key) and
returns an object with the rollout engine protocol (`vlmreg.rollout.RolloutEngine`: ``chat(conversations, params,
template_kwargs=None, names=None) -> list[ChatTurn]``). A ``server`` engine samples from a server that runs apart: the
trainer launches or attaches to it (``[rollout] launch`` / ``url``) and syncs its weights (``[broadcast] transport``).
A ``thinking_budget`` engine applies ``SamplingParams.thinking_budget`` (`vlmreg.rollout.thinking`) and reports the
completions it cut (``Completion.thinking_forced``); ``[rollout] thinking_budget`` is refused for any other.
Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from vlmreg.sdk.descriptor import _check_bool, _check_callable, _check_name

__all__ = ["Engine"]


@attrs.frozen(kw_only=True, eq=False)
class Engine:
    """A rollout engine: ``build(context) -> engine``; ``server``: whether it samples from a server apart;
    ``thinking_budget``: whether it ends the thinking after ``SamplingParams.thinking_budget`` thinking tokens."""

    name: str = attrs.field(validator=_check_name)
    build: Callable[[Any], Any] = attrs.field(validator=_check_callable(optional=False, what="a callable taking an EngineContext"))
    server: bool = attrs.field(default=False, validator=_check_bool)
    thinking_budget: bool = attrs.field(default=False, validator=_check_bool)
    description: str = ""
