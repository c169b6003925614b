"""vlmreg's built-in rollout engines, registered through ``vlmreg_register_rollout_engines`` like a third party's.

``embedded`` samples with transformers ``generate`` from the very weights being trained; ``openai`` sends
conversations to an OpenAI-compatible server apart (`vlmreg serve` or vLLM) whose weights the trainer keeps current.
Importing this module is cheap (torch loads when an engine is built), since it loads with the plugins.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from vlmreg.sdk.engine import Engine
from vlmreg.sdk.hookspecs import hookimpl

__all__ = ["BUILTIN", "EngineContext"]


@attrs.frozen(kw_only=True)
class EngineContext:
    """What an engine's ``build`` gets: the run (``rc``: its `ResolvedConfig`), the model being trained, its processor,
    the run's image store, the device, the family's descriptor, the output directory, and for a server engine the
    server's ``url`` and ``api_key``, and for vLLM its ``cache_scope`` (`vlmreg.rollout.cache_scope.CacheScope`): an
    engine that puts it on its requests sets ``cache_scope.applied``, else the server's caches are cleared every sync."""

    rc: Any
    model: Any
    processor: Any
    store: Any
    device: Any
    descriptor: Any
    output_dir: Path
    url: str | None = None
    api_key: str | None = None
    cache_scope: Any = None


def _embedded(ctx: EngineContext) -> Any:
    from vlmreg.rollout.embedded import EmbeddedEngine

    batch = ctx.rc.config.rollout.max_concurrent_rollouts
    return EmbeddedEngine(ctx.model, ctx.processor, ctx.store, ctx.device, batch_size=batch, descriptor=ctx.descriptor)


def _openai(ctx: EngineContext) -> Any:
    from vlmreg.rollout.openai_client import OpenAIEngine

    return OpenAIEngine.from_config(ctx.rc.config.rollout, ctx.processor, ctx.store, ctx.descriptor, url=ctx.url, api_key=ctx.api_key,
                                   cache_scope=ctx.cache_scope)


BUILTIN = (
    Engine(name="embedded", build=_embedded, thinking_budget=True, description="transformers generate on the trained weights, in the trainer"),
    Engine(name="openai", build=_openai, server=True, thinking_budget=True,
           description="an OpenAI-compatible server apart (vlmreg serve, vLLM), launched or attached, weights synced"),
)


@hookimpl
def vlmreg_register_rollout_engines(register: Callable[[Engine], None]) -> None:
    """Register ``embedded`` and ``openai``."""
    for engine in BUILTIN:
        register(engine)
