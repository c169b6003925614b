"""vlmreg's built-in rollout engines, registered through ``vlmreg_register_rollout_engines`` like a third party's.

``embedded`` samples with transformers ``generate`` from the very weights being trained; ``openai`` sends
conversations to an OpenAI-compatible server apart (`vlmreg serve` or vLLM) whose weights the trainer keeps current.
Importing this module is cheap (torch loads when an engine is built), since it loads with the plugins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vlmreg.sdk.engine import Engine, EngineContext
from vlmreg.sdk.hookspecs import hookimpl

__all__ = ["BUILTIN"]


def _embedded(ctx: EngineContext) -> Any:
    # deferred: start-up cost (loads torch, urllib.request)
    from vlmreg.inference.embedded import EmbeddedEngine  # noqa: PLC0415

    batch = ctx.rc.config.rollout.max_concurrent_rollouts
    return EmbeddedEngine(ctx.model, ctx.processor, ctx.store, ctx.device, batch_size=batch, descriptor=ctx.descriptor)


def _openai(ctx: EngineContext) -> Any:
    # deferred: start-up cost (loads concurrent, http, torch, urllib.request)
    from vlmreg.inference.openai_client import OpenAIEngine  # noqa: PLC0415

    return OpenAIEngine.from_config(
        ctx.rc.config.rollout,
        ctx.processor,
        ctx.store,
        ctx.descriptor,
        url=ctx.url,
        api_key=ctx.api_key,
        cache_scope=ctx.cache_scope,
    )


BUILTIN = (
    Engine(
        name="embedded",
        build=_embedded,
        thinking_budget=True,
        description="transformers generate on the trained weights, in the trainer",
    ),
    Engine(
        name="openai",
        build=_openai,
        server=True,
        thinking_budget=True,
        description="an OpenAI-compatible server apart (vlmreg serve, vLLM), launched or attached, weights synced",
    ),
)


@hookimpl
def vlmreg_register_rollout_engines(register: Callable[[Engine], None]) -> None:
    """Register ``embedded`` and ``openai``."""
    for engine in BUILTIN:
        register(engine)
