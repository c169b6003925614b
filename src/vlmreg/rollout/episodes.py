"""Running episodes: many environments at once, each turn batched through one engine call.

A trajectory keeps, per turn, the exact prompt tokens the engine saw and the completion tokens and
logprobs it returned; training samples are built from these tokens, never by re-tokenizing text. With an
engine that takes token prompts (``engine.complete``, with its ``encoder``), every later turn's prompt is
the previous prompt, the sampled completion and the environment's reply as the template renders it after
a turn (`PromptEncoder.extend`), so turns merge into one sample (unless the image budget below drops an image). Other
engines get the conversation as messages and render it themselves.

Environments see the completion's answer: the text after the family's thinking end marker, when the
family has one; the full text stays on the trajectory. A turn's environment calls (``reset``, ``step``; plain or
``async def``) run concurrently, bounded and timed (`vlmreg.envs.calls`).

With an image budget (``max_images_in_context = K``), every conversation is kept under `apply_image_budget`: the
engine sees only the last K images. When a reply pushes an older image out, that image's place in the conversation
becomes a text marker, so the next prompt no longer extends the previous one token for token: the prompt is encoded
again from the budgeted conversation (the sampled completion tokens are kept as they were) and the turn is marked
``budget_break``; training samples split there (`vlmreg.train.samples`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from vlmreg.envs.calls import (
    EnvCall,
    EnvironmentFailure,
    call_environments,
    close_environments,
    environment_name,
)
from vlmreg.envs.single_turn import SingleTurnEnvironment
from vlmreg.rollout.image_budget import apply_media_budget
from vlmreg.sdk.engine import ChatTurn, EncodedPrompt, RolloutEngine, SamplingParams
from vlmreg.sdk.environment import Environment, EnvStep
from vlmreg.sdk.example import Example

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
    #: this turn's prompt dropped images the previous turn's prompt had (the image budget): it does not extend it
    budget_break: bool = False
    #: the thinking budget ended this turn's thinking (`vlmreg.inference.thinking`)
    thinking_forced: bool = False
    #: positions in ``completion_ids`` the engine wrote itself (`Completion.forced`): kept out of the loss
    forced: tuple[int, ...] = ()


@attrs.define
class Trajectory:
    """One episode of one example: its turns, total reward, and which GRPO group it belongs to."""

    example: Example
    group: int
    turns: list[Turn] = attrs.field(factory=list)
    images_dropped: int = 0  # every image the model did not see: over a message's limit, or out of the budget
    images_over_budget: int = 0  # of those, the ones the image budget replaced by a marker
    videos_dropped: int = 0  # every video the model did not see: over a message's limit, or out of the video budget
    info: dict[str, Any] = attrs.field(factory=dict)
    policy_version: int = 0  # optimizer steps the sampling weights had taken (set by the trainer's collect)

    @property
    def reward(self) -> float:
        return sum(t.reward for t in self.turns)


def _limit_images(
    messages: list[Mapping[str, Any]], limit: int, kind: str = "image"
) -> tuple[list[Mapping[str, Any]], int]:
    """Keep at most ``limit`` images (``kind="video"``: videos) per message (the first ones); return the messages and
    how many were dropped."""
    dropped = 0
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            out.append(message)
            continue
        kept, seen = [], 0
        for part in content:
            if part.get("type") == kind:
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
    return {**message, "content": [p for p in content if p.get("type") in ("image", "video")]}


def strip_reasoning(completion: str, thinking_end: str | None) -> str:
    """The completion after its reasoning: the text after the last ``thinking_end`` marker, or all of it."""
    return completion.rsplit(thinking_end, 1)[-1] if thinking_end else completion


def _prefetch_rewards(
    envs: Sequence[Any],
    live: Sequence[int],
    turns: Sequence[ChatTurn],
    trajectories: Sequence[Trajectory],
    thinking_end: str | None,
) -> None:
    """Await the async reward functions of this turn's single-turn environments at once (bounded, each with its
    timeout), so each environment's own reward call finds its score ready; synchronous rewards are left alone."""
    batches: dict[int, tuple[Any, list[tuple[int, str, Any, str]]]] = {}
    for i, chat_turn in zip(live, turns, strict=True):
        env = envs[i]
        if getattr(type(env), "step", None) is not SingleTurnEnvironment.step or not getattr(
            env.reward, "has_async", False
        ):
            continue
        example = trajectories[i].example
        batches.setdefault(id(env.reward), (env.reward, []))[1].append(
            (i, strip_reasoning(chat_turn.text, thinking_end), example.answer, example.id)
        )
    for reward, samples in batches.values():
        reward.prefetch(samples)


def _split(flat: list[Mapping[str, Any]], sizes: Sequence[int]) -> list[list[Mapping[str, Any]]]:
    out, at = [], 0
    for size in sizes:
        out.append(flat[at : at + size])
        at += size
    return out


@attrs.define
class _Episode:
    """One live episode's conversation, kept under the image budget: the environment's message chunks (the reset's,
    then one reply per turn) and the assistant texts and completion tokens between them."""

    chunks: list[list[Mapping[str, Any]]]
    texts: list[str] = attrs.field(factory=list)
    completions: list[list[int]] = attrs.field(factory=list)

    def conversation(self) -> list[Mapping[str, Any]]:
        out = list(self.chunks[0])
        for text, chunk in zip(self.texts, self.chunks[1:], strict=True):
            out += [{"role": "assistant", "content": text}, *chunk]
        return out

    def add(
        self, text: str, completion: list[int], reply: list[Mapping[str, Any]], budget: tuple[int | None, int | None]
    ) -> tuple[int, int]:
        """Append a turn; apply the image and video budgets to the whole conversation; return how many images and
        videos they replaced."""
        self.texts.append(text)
        self.completions.append(completion)
        self.chunks.append(reply)
        sizes = [len(c) for c in self.chunks]
        flat, images, videos = apply_media_budget([m for c in self.chunks for m in c], *budget)
        if images or videos:
            self.chunks = _split(flat, sizes)
        return images, videos

    def encode(self, encoder: Any, template_kwargs: Mapping[str, Any] | None, where: str) -> EncodedPrompt:
        """The prompt of the (budgeted) conversation: the first messages encoded, then each sampled completion's
        tokens and the reply after it, as `PromptEncoder.extend` continues a conversation."""
        prompt = encoder.encode(self.chunks[0], template_kwargs=template_kwargs, where=where)
        for completion, chunk in zip(self.completions, self.chunks[1:], strict=True):
            prompt = encoder.extend(prompt, completion, chunk, template_kwargs=template_kwargs, where=where)
        return prompt


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
    max_images_in_context: int | None = None,
    env_timeout_s: float | None = None,
    env_concurrency: int = 32,
    max_videos_per_message: int | None = None,
    max_videos_in_context: int | None = None,
) -> list[Trajectory]:
    """Play every ``(example, group)`` to the end; each turn is one batched engine call over the live episodes.

    With ``image_only``, the environment's replies reach the model as their images alone (text parts removed).
    ``max_images_in_context`` (``None``/0: no limit) keeps each conversation's last K images (`apply_image_budget`);
    ``max_videos_in_context`` the last K videos. ``max_videos_per_message`` (``None``: no limit) drops the videos of an
    environment's message past it, counted in ``videos_dropped``.
    The environments' calls of a turn run concurrently, at most ``env_concurrency`` at once, each within
    ``env_timeout_s``; a failure ends the run with an error naming the environment, the call and the example.
    """
    envs = [make_env(example) for example, _ in examples]
    try:
        return _play(
            examples,
            envs,
            engine,
            params,
            max_images_per_message=max_images_per_message,
            template_kwargs=template_kwargs,
            max_turns=max_turns,
            image_only=image_only,
            thinking_end=thinking_end,
            on_drop=on_drop,
            budget=(max_images_in_context or None, max_videos_in_context or None),
            timeout_s=env_timeout_s,
            concurrency=env_concurrency,
            video_limit=max_videos_per_message,
        )
    finally:
        close_environments(envs)


def _play(
    examples: Sequence[tuple[Example, int]],
    envs: list[Any],
    engine: RolloutEngine,
    params: SamplingParams,
    *,
    max_images_per_message: int,
    template_kwargs: Mapping[str, Any] | None,
    max_turns: int,
    image_only: bool,
    thinking_end: str | None,
    on_drop: Callable[[str, int], None] | None,
    budget: tuple[int | None, int | None],
    timeout_s: float | None,
    concurrency: int,
    video_limit: int | None = None,
) -> list[Trajectory]:
    trajectories = [Trajectory(example, group) for example, group in examples]
    resets = call_environments(
        [
            EnvCall(env, "reset", (example,), example.id, i)
            for i, (env, (example, _)) in enumerate(zip(envs, examples, strict=True))
        ],
        timeout_s=timeout_s,
        concurrency=concurrency,
    )
    episodes: list[_Episode] = []
    for env, (example, _), trajectory, first in zip(envs, examples, trajectories, resets, strict=True):
        if not isinstance(first, (list, tuple)):
            raise EnvironmentFailure(
                f"{environment_name(env)}.reset failed on {example.id}: returned {type(first).__name__}, not a list of "
                "messages"
            )
        messages, dropped = _limit_images(list(first), max_images_per_message)
        trajectory.images_dropped += dropped
        if dropped and on_drop:
            on_drop(example.id, dropped)
        if video_limit is not None:
            messages, dropped = _limit_images(messages, video_limit, "video")
            trajectory.videos_dropped += dropped
        messages, over, videos_over = apply_media_budget(messages, *budget)
        trajectory.images_dropped += over
        trajectory.images_over_budget += over
        trajectory.videos_dropped += videos_over
        episodes.append(_Episode([messages]))
    encoder = getattr(engine, "encoder", None) if hasattr(engine, "complete") else None
    prompts: list[EncodedPrompt | None] = [None] * len(examples)
    breaks = [False] * len(examples)
    live = list(range(len(examples)))
    for _ in range(max_turns):
        if not live:
            break
        names = [trajectories[i].example.id for i in live]
        if encoder is not None:
            for i, name in zip(live, names, strict=True):
                if prompts[i] is None:
                    prompts[i] = episodes[i].encode(encoder, template_kwargs, name)
            encoded = [prompt for i in live if (prompt := prompts[i]) is not None]  # each one encoded just above
            completions = engine.complete(encoded, params)  # type: ignore[attr-defined]
            decode = encoder.tokenizer.decode
            turns = [
                ChatTurn(p, c, decode(c.token_ids, skip_special_tokens=True))
                for p, c in zip(encoded, completions, strict=True)
            ]
        else:
            turns = engine.chat(
                [episodes[i].conversation() for i in live], params, template_kwargs=template_kwargs, names=names
            )
        _prefetch_rewards(envs, live, turns, trajectories, thinking_end)
        steps = call_environments(
            [
                EnvCall(envs[i], "step", (strip_reasoning(t.text, thinking_end),), trajectories[i].example.id, i)
                for i, t in zip(live, turns, strict=True)
            ],
            timeout_s=timeout_s,
            concurrency=concurrency,
        )
        still = []
        for i, chat_turn, step in zip(live, turns, steps, strict=True):
            enc, completion, text = chat_turn.prompt, chat_turn.completion, chat_turn.text
            if not isinstance(step, EnvStep):
                raise EnvironmentFailure(
                    f"{environment_name(envs[i])}.step failed on {trajectories[i].example.id}: returned "
                    f"{type(step).__name__}, not an EnvStep"
                )
            trajectories[i].turns.append(
                Turn(
                    enc.input_ids,
                    enc.image_ids,
                    enc.image_spans,
                    completion.token_ids,
                    completion.logprobs,
                    text,
                    completion.finish_reason,
                    step.reward,
                    breaks[i],
                    getattr(completion, "thinking_forced", False),
                    tuple(getattr(completion, "forced", ())),
                )
            )
            trajectories[i].info.update(step.info)
            if not step.done:
                reply = [_images_only(m) for m in step.messages] if image_only else list(step.messages)
                reply, dropped = _limit_images(reply, max_images_per_message)
                trajectories[i].images_dropped += dropped
                if dropped and on_drop:
                    on_drop(trajectories[i].example.id, dropped)
                if video_limit is not None:
                    reply, dropped = _limit_images(reply, video_limit, "video")
                    trajectories[i].videos_dropped += dropped
                over, videos_over = episodes[i].add(text, list(completion.token_ids), reply, budget)
                trajectories[i].images_dropped += over
                trajectories[i].images_over_budget += over
                trajectories[i].videos_dropped += videos_over
                over += videos_over
                breaks[i] = over > 0
                if encoder is not None:
                    if over:  # the budget changed the prefix: encode the budgeted conversation again
                        prompts[i] = episodes[i].encode(encoder, template_kwargs, trajectories[i].example.id)
                    else:
                        prompts[i] = encoder.extend(
                            enc,
                            completion.token_ids,
                            episodes[i].chunks[-1],
                            template_kwargs=template_kwargs,
                            where=trajectories[i].example.id,
                        )
                still.append(i)
        live = still
    return trajectories
