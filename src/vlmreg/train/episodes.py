"""The trainer's episodes: this rank's share of the examples played on the rollout engine, and the greedy evaluation.

The embedded engine samples from the trainer's own model, so its parameters are gathered for it (FSDP2) and it runs
eagerly (compiled layers would recompile at every token); a failed request to a launched server that has died reports
the death instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from vlmreg.rollout.episodes import Trajectory, run_episodes
from vlmreg.sdk.engine import SamplingParams
from vlmreg.sdk.errors import VlmregError
from vlmreg.train.distributed import unsharded

__all__ = ["evaluate_greedy", "play_episodes"]


@contextlib.contextmanager
def _eager(compiled: bool) -> Iterator[None]:
    """Generation runs eagerly even when the layers are compiled (its shapes change at every token)."""
    if not compiled:
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


@contextlib.contextmanager
def _server_errors(link: Any) -> Iterator[None]:
    """A failed request to a launched server that has died reports the death (exit code, log) instead."""
    try:
        yield
    except VlmregError:
        if link is not None:
            link.check_alive()
        raise


def play_episodes(
    trainer: Any,
    examples: list[Any],
    *,
    group_size: int,
    sampling: SamplingParams,
    make_env: Callable[[Any], Any],
) -> list[Trajectory]:
    """Episodes of a set-up `vlmreg.train.recipe.Trainer` for this rank's share of ``examples`` (all of them in one
    process), ``group_size`` each, in the environments ``make_env`` makes."""
    config, dist = trainer.config, trainer.dist
    if dist is not None:
        examples = examples[dist.rank :: dist.world]
    pairs = [(example, g) for g, example in enumerate(examples) for _ in range(group_size)]
    limit = config.rollout.max_images_per_step or 0

    def dropped(example_id: str, count: int) -> None:
        trainer.log(
            f"warning: {example_id}: dropped {count} image(s) of a message over rollout.max_images_per_step = {limit}"
        )

    local = trainer.link is None  # the embedded engine samples from the trainer's own (sharded, compiled) model
    gathered = unsharded(trainer.model, dist) if local else contextlib.nullcontext()
    with gathered, _eager(config.trainer.compile and local), _server_errors(trainer.link):
        return run_episodes(
            pairs,
            make_env,
            trainer.engine,
            sampling,
            max_images_per_message=limit,
            template_kwargs=trainer.template_kwargs,
            image_only=config.rollout.image_only_mode,
            thinking_end=trainer.resolved.descriptor.thinking_end,
            on_drop=dropped,
            max_images_in_context=config.rollout.max_images_in_context,
            max_videos_in_context=config.rollout.max_videos_in_context,
            max_videos_per_message=trainer.resolved.descriptor.max_videos_per_message,
            env_timeout_s=config.rollout.env_timeout_s,
            env_concurrency=config.rollout.env_concurrency,
            max_turns=config.rollout.max_turns,
        )


@torch.no_grad()
def evaluate_greedy(trainer: Any, data: Any) -> dict[str, float]:
    """Greedy decoding on ``data`` (the held-out split's `vlmreg.train.source.RunData`), a collection of its own, with
    no batch collected meanwhile and the random state left as it was: the mean reward over every rank (and its size)."""
    state = torch.get_rng_state()
    greedy = attrs.evolve(trainer.sampling, greedy=True)
    holding = trainer.ahead.exclusive() if trainer.ahead is not None else contextlib.nullcontext()
    try:
        with holding:
            trajectories = trainer.rollouts(data.examples, group_size=1, sampling=greedy, make_env=data.make_env)
    finally:
        torch.set_rng_state(state)
    values = [sum(t.reward for t in trajectories), float(len(trajectories))]
    total, count = trainer.dist.sum(values) if trainer.dist is not None else values
    return {"eval_reward_mean": total / count, "eval_samples": count}
