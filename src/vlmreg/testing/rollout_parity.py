"""Parity of a family's rollouts with independent references (no pytest needed; `vlmreg.testing.parity` holds the
prompt and logprob checks and the helpers these build on), and `parity_report`, every check of a family in order:

- `stop_parity`: generation stops at the family's turn end, the token the chat template closes a turn with, and the
  sampler's logprobs equal a plain forward's;
- `multiturn_parity`: a 3-turn conversation continued from the sampled tokens equals the processor's encoding of the
  whole conversation and merges into one sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import attrs as _attrs

from vlmreg.sdk.engine import Completion, RolloutEngine, SamplingParams
from vlmreg.sdk.environment import EnvStep
from vlmreg.sdk.errors import VlmregError
from vlmreg.testing.parity import (
    ANSWER,
    IMAGE_SIZES,
    QUESTION,
    SAMPLER_TOLERANCE,
    Parity,
    _load,
    _reference,
    _samples,
    _setup,
    logprob_parity,
    noise_image,
    plain_logprobs,
    prompt_parity,
)

__all__ = ["multiturn_parity", "parity_report", "stop_parity"]


def stop_parity(family: str) -> list[Parity]:
    """Generation stops at the family's turn-end token, the one the chat template closes an assistant turn with, and
    the sampler's logprobs (prompts of mixed image sizes sampled together) equal a plain forward's."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    # deferred: start-up cost (loads urllib.request)
    from vlmreg.data import ImageStore  # noqa: PLC0415
    from vlmreg.data.prompts import vision_token_ids  # noqa: PLC0415

    # deferred: start-up cost (loads torch, urllib.request)
    from vlmreg.inference.embedded import EmbeddedEngine  # noqa: PLC0415

    loaded = _load(family)
    descriptor = loaded.resolved.descriptor
    engine = EmbeddedEngine(loaded.model, loaded.processor, ImageStore(), loaded.device, descriptor=descriptor)
    encoder = engine.encoder
    turn_end = encoder.stop_ids[0]
    try:
        text, closing = encoder.continuation_text([{"role": "user", "content": QUESTION}])
    except VlmregError as exc:  # the template closes turns with none of the family's turn-end tokens
        return [Parity("stops at the turn end", False, str(exc))]
    if closing != turn_end:
        names = encoder.tokenizer.convert_ids_to_tokens([turn_end, closing])
        return [
            Parity(
                "stops at the turn end",
                False,
                f"the family's first turn-end token is {names[0]!r}, but the chat template closes an assistant turn "
                f"with {names[1]!r}",
            )
        ]
    samples = _samples(encoder, IMAGE_SIZES, descriptor)
    prompts = [
        encoder.encode(
            [
                {
                    "role": "user",
                    "content": [
                        *({"type": "image", "image": i} for i in s.image_ids),
                        {"type": "text", "text": QUESTION},
                    ],
                }
            ]
        )
        for _, s in samples
    ]
    vocab = loaded.model.get_input_embeddings().num_embeddings
    only_end = SamplingParams(
        max_tokens=4,
        suppress_token_ids=tuple(i for i in range(vocab) if i != turn_end),
        stop_token_ids=encoder.stop_ids,
    )
    completions = engine.complete(prompts, only_end)
    bad = [c for c in completions if c.token_ids != [turn_end] or c.finish_reason != "stop"]
    token = encoder.tokenizer.convert_ids_to_tokens(turn_end)
    results = [
        Parity(
            "stops at the turn end",
            not bad,
            f"{token!r} (id {turn_end}) ends every completion; the template continues with {text[:24]!r}"
            if not bad
            else f"completions {[c.token_ids for c in bad]} did not stop at {token!r}",
        )
    ]
    vision = vision_token_ids(loaded.processor, descriptor)  # sampled text never claims image features
    free = engine.complete(prompts, _attrs.evolve(only_end, suppress_token_ids=vision, stop_token_ids=(), max_tokens=6))
    worst = max(
        float(
            (
                plain_logprobs(loaded.model, loaded.processor, pil, c.token_ids, vision, prefix_lm=descriptor.prefix_lm)
                - torch.tensor(c.logprobs)
            )
            .abs()
            .max()
        )
        for (pil, _), c in zip(samples, free, strict=True)
    )
    images = [len(p.image_ids) for p in prompts]
    ok = worst <= SAMPLER_TOLERANCE
    results.append(
        Parity(
            "sampler logprobs",
            ok,
            f"{len(prompts)} prompts with {images} images sampled together; max |sampler - plain forward| = "
            f"{worst:.1e} (tolerance {SAMPLER_TOLERANCE:.0e})",
            worst,
        )
    )
    return results


class _ScriptedEngine:
    """Answers every prompt with the same tokens; what it is given is what the episode runner built."""

    def __init__(self, encoder: Any, answer: list[int]) -> None:
        self.encoder, self.answer = encoder, answer

    def complete(self, prompts: Sequence[Any], params: Any) -> list[Any]:
        return [Completion(list(self.answer), [-1.0] * len(self.answer), "stop") for _ in prompts]


def multiturn_parity(family: str, turns: int = 3) -> list[Parity]:
    """Turns continued from the sampled tokens equal the processor's encoding of the whole conversation, and merge."""
    # deferred: start-up cost (loads urllib.request)
    from vlmreg.data import Example  # noqa: PLC0415

    # deferred: start-up cost (loads asyncio, concurrent)
    from vlmreg.rollout.episodes import run_episodes  # noqa: PLC0415

    # deferred: start-up cost (loads asyncio, concurrent, urllib.request)
    from vlmreg.train.samples import build_samples  # noqa: PLC0415

    descriptor, processor, encoder = _setup(family)
    if descriptor.prefix_lm:
        return _prefix_lm_turns(family, encoder, turns)
    per_message = max(descriptor.max_images_per_message, 0)
    images = [noise_image(size, 100 + k) for k, size in enumerate(IMAGE_SIZES[:turns])] if per_message else []
    ids = [encoder.store.add(im) for im in images]

    def user(k: int, pil: bool) -> dict:
        parts = [{"type": "image", "image": (images if pil else ids)[k]}] if images else []
        return {"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}

    class Env:
        def __init__(self) -> None:
            self.turn = 0

        def reset(self, example: Any) -> list:
            return [user(0, False)]

        def step(self, completion: str) -> EnvStep:
            self.turn += 1
            done = self.turn >= turns
            return EnvStep(reward=1.0, done=done, messages=() if done else (user(self.turn, False),))

    answer = encoder.tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [encoder.stop_ids[0]]
    engine = _ScriptedEngine(encoder, answer)
    example = Example("multiturn", [user(0, False)], answer=ANSWER)
    try:
        token_engine = cast(RolloutEngine, engine)  # token-level: run_episodes calls its complete(), never chat()
        [trajectory] = run_episodes(
            [(example, 0)],
            lambda e: Env(),
            token_engine,
            SamplingParams(),
            max_images_per_message=per_message,
            max_turns=turns,
        )
    except VlmregError as exc:
        return [Parity(f"{turns}-turn prompt", False, str(exc))]
    history = []
    for k in range(turns):
        history.append(user(k, True))
        if k < turns - 1:
            history.append({"role": "assistant", "content": ANSWER})
    want = _reference(processor, history)["input_ids"][0].tolist()
    got = trajectory.turns[-1].prompt_ids
    same = got == want
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    samples, stats = build_samples([trajectory], [1.0], seq_len=1 << 16, check=encoder.check)
    merged = len(samples) == 1 and stats.prefix_breaks == 0 and stats.merged_turns == turns - 1
    return [
        Parity(
            f"{turns}-turn prompt",
            same,
            "equals the processor's encoding of the whole conversation"
            if same
            else f"token {at} differs: vlmreg {got[at : at + 4]} vs processor {want[at : at + 4]}",
            float(at) if not same else 0.0,
        ),
        Parity(
            f"{turns}-turn merge",
            merged,
            f"{len(samples)} sample(s), {stats.merged_turns} turn(s) merged, {stats.prefix_breaks} prefix break(s)",
        ),
    ]


def _prefix_lm_turns(family: str, encoder: Any, turns: int) -> list[Parity]:
    """A prefix-LM family's episodes take one turn: continuing a prompt after a sampled turn is refused, naming the
    descriptor field (the processor writes a conversation as one prefix, so no later prompt extends an earlier one)."""
    image = encoder.store.add(noise_image(IMAGE_SIZES[0], 100))
    prompt = encoder.encode(
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}]
    )
    answer = encoder.tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [encoder.stop_ids[0]]
    try:
        encoder.extend(prompt, answer, [{"role": "user", "content": QUESTION}])
    except VlmregError as exc:
        refused = "prefix_lm" in str(exc)
        detail = "a second turn is refused naming prefix_lm: episodes take one turn" if refused else str(exc)
        return [Parity(f"{turns}-turn prompt", refused, detail)]
    return [
        Parity(
            f"{turns}-turn prompt",
            False,
            f"family {family} declares prefix_lm, yet a prompt was continued after a sampled turn",
        )
    ]


def parity_report(family: str) -> list[Parity]:
    """Every parity check of a family, in order (the video checks are
    `vlmreg.testing.video_parity.video_parity_report`)."""
    return [*prompt_parity(family), *logprob_parity(family), *stop_parity(family), *multiturn_parity(family)]
