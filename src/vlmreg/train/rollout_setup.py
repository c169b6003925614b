"""A run's rollout side, as ``Trainer.setup`` builds it: the engine ``[rollout] engine`` names (from the registry;
one per server apart, pooled), the link to a server apart, the prompt encoder and the sampling parameters."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from vlmreg.config.resolve import ResolvedConfig
from vlmreg.data.prompts import PromptEncoder, vision_token_ids
from vlmreg.data.store import ImageStore
from vlmreg.loading.load import LoadedModel
from vlmreg.sdk.engine import EngineContext, SamplingParams

__all__ = ["RolloutSide", "build_rollout_side"]


@attrs.frozen
class RolloutSide:
    """The engine (a `vlmreg.inference.server_pool.ServerPool` over several servers), the `ServerLink` to a server apart
    (``None``: the engine runs in the trainer), the prompt encoder and the sampling parameters."""

    engine: Any
    link: Any
    encoder: PromptEncoder
    sampling: SamplingParams


def build_rollout_side(
    rc: ResolvedConfig,
    loaded: LoadedModel,
    store: ImageStore,
    *,
    output_dir: Path,
    log: Callable[[str], None],
    dist: Any,
) -> RolloutSide:
    """Build the run's rollout side; a server engine's servers are launched (or attached) here."""
    rollout, descriptor = rc.config.rollout, loaded.resolved.descriptor
    link = None
    spec = rc.specs.engine  # [rollout] engine: the registered rollout engine, looked up by resolve_config
    assert spec is not None, "resolve_config looks the engine up"
    context = EngineContext(
        rc=rc,
        model=loaded.model,
        processor=loaded.processor,
        store=store,
        device=loaded.device,
        descriptor=descriptor,
        output_dir=output_dir,
    )
    if spec.server:  # a server apart: launched or attached, its weights kept the trainer's
        # deferred: the server side's imports, only for runs that have one
        from vlmreg.inference.server_link import ServerLink  # noqa: PLC0415

        link = ServerLink(
            rc,
            loaded.resolved,
            loaded.device,
            output_dir,
            log,
            dist,
            processor=loaded.processor,
            peft_model=loaded.model if loaded.lora is not None else None,
        )
        context = attrs.evolve(context, url=link.url, api_key=link.api_key, cache_scope=link.cache_scope)
    engine: Any = spec.build(context)
    if link is not None and len(link.urls) > 1:  # one engine per server; each prompt group on one of them
        # deferred: with the server side
        from vlmreg.inference.server_pool import ServerPool  # noqa: PLC0415

        engines = [engine] + [spec.build(attrs.evolve(context, url=url)) for url in link.urls[1:]]
        engine = ServerPool(engines, link.urls)
    encoder: PromptEncoder = getattr(engine, "encoder", None) or PromptEncoder(loaded.processor, store, descriptor)
    sampling = SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        max_tokens=rollout.max_tokens,
        stop_token_ids=encoder.stop_ids,
        suppress_token_ids=vision_token_ids(loaded.processor, descriptor),
        thinking_budget=rollout.thinking_budget,
    )
    return RolloutSide(engine, link, encoder, sampling)
