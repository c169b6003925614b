"""Running episodes: many environments at once, each turn batched through one engine call.

A trajectory keeps, per turn, the exact prompt tokens the engine saw and the completion tokens and
logprobs it returned; training samples are built from these tokens, never by re-tokenizing text. With an
engine that takes token prompts (``engine.complete``, with its ``encoder``), every later turn's prompt is
the previous prompt, the sampled completion and the environment's reply as the template renders it after
a turn (`PromptEncoder.extend`), so turns always merge into one sample. Other engines get the conversation
as messages and render it themselves.

Environments see the completion's answer: the text after the family's thinking end marker, when the
family has one; the full text stays on the trajectory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from vlmreg.data.example import Example
from vlmreg.data.prompts import EncodedPrompt
from vlmreg.rollout.engine import ChatTurn, RolloutEngine, SamplingParams
from vlmreg.rollout.environment import Environment, SingleTurnEnvironment
from vlmreg.sdk.errors import RewardError, VlmregError

__all__ = ["EnvironmentFailure", "Trajectory", "Turn", "run_episodes", "strip_reasoning"]


@attrs.frozen
class Turn:
    prompt_ids: list[int]
    image_ids: list[str]
    image_spans: list[tuple[int, int]]
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
    policy_version: int = 0  # optimizer steps the sampling weights had taken (set by the trainer's collect)

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


def strip_reasoning(completion: str, thinking_end: str | None) -> str:
    """The completion after its reasoning: the text after the last ``thinking_end`` marker, or all of it."""
    return completion.rsplit(thinking_end, 1)[-1] if thinking_end else completion


class EnvironmentFailure(VlmregError):
    """An environment raised while scoring or replying; the message names the example."""


def _prefetch_rewards(envs: Sequence[Any], live: Sequence[int], turns: Sequence[ChatTurn], trajectories: Sequence[Trajectory], thinking_end: str | None) -> None:
    """Await the async reward functions of this turn's single-turn environments at once (bounded, each with its
    timeout), so each environment's own reward call finds its score ready; synchronous rewards are left alone."""
    batches: dict[int, tuple[Any, list[tuple[int, str, Any, str]]]] = {}
    for i, chat_turn in zip(live, turns, strict=True):
        env = envs[i]
        if type(env).step is not SingleTurnEnvironment.step or not getattr(env.reward, "has_async", False):
            continue
        example = trajectories[i].example
        batches.setdefault(id(env.reward), (env.reward, []))[1].append((i, strip_reasoning(chat_turn.text, thinking_end), example.answer, example.id))
    for reward, samples in batches.values():
        reward.prefetch(samples)


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
    thinking_end: str | None = None,
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
    encoder = getattr(engine, "encoder", None) if hasattr(engine, "complete") else None
    prompts: list[EncodedPrompt | None] = [None] * len(examples)
    live = list(range(len(examples)))
    for _ in range(max_turns):
        if not live:
            break
        names = [trajectories[i].example.id for i in live]
        if encoder is not None:
            for i, name in zip(live, names, strict=True):
                if prompts[i] is None:
                    prompts[i] = encoder.encode(conversations[i], template_kwargs=template_kwargs, where=name)
            encoded = [prompts[i] for i in live]
            completions = engine.complete(encoded, params)  # type: ignore[attr-defined]
            decode = encoder.tokenizer.decode
            turns = [ChatTurn(p, c, decode(c.token_ids, skip_special_tokens=True)) for p, c in zip(encoded, completions, strict=True)]
        else:
            turns = engine.chat([conversations[i] for i in live], params, template_kwargs=template_kwargs, names=names)
        _prefetch_rewards(envs, live, turns, trajectories, thinking_end)
        still = []
        for i, chat_turn in zip(live, turns, strict=True):
            enc, completion, text = chat_turn.prompt, chat_turn.completion, chat_turn.text
            try:
                step = envs[i].step(strip_reasoning(text, thinking_end))
            except RewardError as exc:  # name the sample: its index in this batch and its example
                raise exc.on_sample(i, trajectories[i].example.id) from exc.__cause__
            except VlmregError:
                raise
            except Exception as exc:
                raise EnvironmentFailure(
                    f"{type(envs[i]).__name__}.step failed on {trajectories[i].example.id}: {type(exc).__name__}: {exc}"
                ) from exc
            trajectories[i].turns.append(
                Turn(enc.input_ids, enc.image_ids, enc.image_spans, completion.token_ids, completion.logprobs, text, completion.finish_reason, step.reward)
            )
            trajectories[i].info.update(step.info)
            if not step.done:
                reply = [_images_only(m) for m in step.messages] if image_only else list(step.messages)
                reply, dropped = _limit_images(reply, max_images_per_message)
                trajectories[i].images_dropped += dropped
                if dropped and on_drop:
                    on_drop(trajectories[i].example.id, dropped)
                conversations[i] = [*conversations[i], {"role": "assistant", "content": text}, *reply]
                if encoder is not None:
                    prompts[i] = encoder.extend(enc, completion.token_ids, reply, template_kwargs=template_kwargs, where=trajectories[i].example.id)
                still.append(i)
        live = still
    return trajectories
