"""Running episodes: many environments at once, each turn batched through one engine call.

A trajectory keeps, per turn, the exact prompt tokens the engine saw and the completion tokens and
logprobs it returned; training samples are built from these tokens, never by re-tokenizing text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from vlmreg.data.example import Example
from vlmreg.rollout.engine import RolloutEngine, SamplingParams
from vlmreg.rollout.environment import Environment
from vlmreg.sdk.errors import VlmregError

__all__ = ["EnvironmentFailure", "Trajectory", "Turn", "run_episodes"]


@attrs.frozen
class Turn:
    prompt_ids: list[int]
    image_ids: list[str]
    image_tokens: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    completion: str
    finish_reason: str
    reward: float


@attrs.define
class Trajectory:
    """One episode of one example: its turns, total reward, and which GRPO group it belongs to."""

    example: Example
    group: int
    turns: list[Turn] = attrs.field(factory=list)
    images_dropped: int = 0
    info: dict[str, Any] = attrs.field(factory=dict)

    @property
    def reward(self) -> float:
        return sum(t.reward for t in self.turns)


def _limit_images(messages: list[Mapping[str, Any]], limit: int) -> tuple[list[Mapping[str, Any]], int]:
    """Keep at most ``limit`` images per message (the first ones); return the messages and how many were dropped."""
    dropped = 0
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            out.append(message)
            continue
        kept, seen = [], 0
        for part in content:
            if part.get("type") == "image":
                seen += 1
                if seen > limit:
                    dropped += 1
                    continue
            kept.append(part)
        out.append({**message, "content": kept})
    return out, dropped


def _images_only(message: Mapping[str, Any]) -> Mapping[str, Any]:
    content = message["content"]
    if isinstance(content, str):
        return {**message, "content": []}
    return {**message, "content": [p for p in content if p.get("type") == "image"]}


class EnvironmentFailure(VlmregError):
    """An environment raised while scoring or replying; the message names the example."""


def run_episodes(
    examples: Sequence[tuple[Example, int]],
    make_env: Callable[[Example], Environment],
    engine: RolloutEngine,
    params: SamplingParams,
    *,
    max_images_per_message: int,
    template_kwargs: Mapping[str, Any] | None = None,
    max_turns: int = 8,
    image_only: bool = False,
    on_drop: Callable[[str, int], None] | None = None,
) -> list[Trajectory]:
    """Play every ``(example, group)`` to the end; each turn is one batched engine call over the live episodes.

    With ``image_only``, the environment's replies reach the model as their images alone (text parts removed).
    An exception in an environment ends the run with an error naming the example and the environment.
    """
    envs = [make_env(example) for example, _ in examples]
    trajectories = [Trajectory(example, group) for example, group in examples]
    conversations: list[list[Mapping[str, Any]]] = []
    for env, (example, _), trajectory in zip(envs, examples, trajectories, strict=True):
        messages, dropped = _limit_images(env.reset(example), max_images_per_message)
        trajectory.images_dropped += dropped
        if dropped and on_drop:
            on_drop(example.id, dropped)
        conversations.append(messages)
    live = list(range(len(examples)))
    for _ in range(max_turns):
        if not live:
            break
        turns = engine.chat(
            [conversations[i] for i in live], params, template_kwargs=template_kwargs, names=[trajectories[i].example.id for i in live]
        )
        still = []
        for i, chat_turn in zip(live, turns, strict=True):
            enc, completion, text = chat_turn.prompt, chat_turn.completion, chat_turn.text
            try:
                step = envs[i].step(text)
            except VlmregError:
                raise
            except Exception as exc:
                raise EnvironmentFailure(
                    f"{type(envs[i]).__name__}.step failed on {trajectories[i].example.id}: {type(exc).__name__}: {exc}"
                ) from exc
            trajectories[i].turns.append(
                Turn(enc.input_ids, enc.image_ids, enc.image_tokens, completion.token_ids, completion.logprobs, text, completion.finish_reason, step.reward)
            )
            trajectories[i].info.update(step.info)
            if not step.done:
                reply = [_images_only(m) for m in step.messages] if image_only else list(step.messages)
                reply, dropped = _limit_images(reply, max_images_per_message)
                trajectories[i].images_dropped += dropped
                if dropped and on_drop:
                    on_drop(trajectories[i].example.id, dropped)
                conversations[i] = [*conversations[i], {"role": "assistant", "content": text}, *reply]
                still.append(i)
        live = still
    return trajectories
