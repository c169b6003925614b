"""The image budget: the last K images of a conversation, the same in rollout and in training samples.

The reference for what the model must see is the processor's own encoding (``apply_chat_template``) of the
conversation truncated by hand here, never vlmreg's encoder.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import vlmreg
from vlmreg.config import parse_config
from vlmreg.data import ImageStore
from vlmreg.data.prompts import PromptEncoder
from vlmreg.inference.embedded import EmbeddedEngine
from vlmreg.rewards import combine
from vlmreg.rollout.episodes import run_episodes
from vlmreg.rollout.image_budget import IMAGE_MARKER, apply_image_budget, count_images
from vlmreg.sdk.engine import ChatTurn, Completion, EncodedPrompt, SamplingParams
from vlmreg.sdk.environment import EnvStep
from vlmreg.sdk.example import Example, image_part, text_part
from vlmreg.tasks import colour_turns
from vlmreg.testing.parity import _reference, tiny_processor
from vlmreg.train.samples import build_samples


def user(*parts):
    return {"role": "user", "content": list(parts)}


# -- the function itself ------------------------------------------------------------------------------------------
def test_keeps_the_last_k_images_and_marks_the_others():
    messages = [
        user(image_part("a"), text_part("one")),
        {"role": "assistant", "content": "x"},
        user(image_part("b"), image_part("c")),
    ]
    kept, dropped = apply_image_budget(messages, 2)
    assert dropped == 1 and count_images(kept) == 2
    assert kept[0]["content"] == [text_part(IMAGE_MARKER), text_part("one")]
    assert kept[1:] == messages[1:]
    # idempotent: a budgeted conversation can grow and be budgeted again
    assert apply_image_budget(kept, 2) == (kept, 0)
    assert apply_image_budget(messages, 1)[0][2]["content"] == [text_part(IMAGE_MARKER), image_part("c")]
    assert apply_image_budget(messages, None) == (messages, 0) and apply_image_budget(messages, 0) == (messages, 0)
    assert messages[0]["content"][0] == image_part("a")  # the input is not changed


# -- rollout with colour_turns: the prompts are the processor's encoding of the truncated conversation -------------
class Scripted:
    """A token-prompt engine answering every prompt with the same tokens (so the reference can render them as text)."""

    def __init__(self, encoder, answer):
        self.encoder, self.answer, self.seen = encoder, answer, []

    def complete(self, prompts, params):
        self.seen += list(prompts)
        return [Completion(list(self.answer), [-1.0] * len(self.answer), "stop") for _ in prompts]


@pytest.fixture(scope="module")
def tiny():
    processor = tiny_processor("qwen3_vl")
    descriptor = vlmreg.get_family("qwen3_vl")
    return processor, descriptor


def reference_ids(processor, store, example, turn, keep, answer):
    """The processor's own ids for turn ``turn`` (1-based) of a colour_turns episode, the first images replaced by
    hand."""
    image_ids = [example.messages[0]["content"][0]["image"], *example.metadata["later_images"]]
    shown = image_ids[:turn]
    hidden = max(0, len(shown) - keep) if keep else 0
    history = []
    for k, image_id in enumerate(shown):
        first = (
            {"type": "text", "text": IMAGE_MARKER} if k < hidden else {"type": "image", "image": store.get(image_id)}
        )
        history.append(user(first, text_part(colour_turns.PROMPT if k == 0 else colour_turns.FOLLOW_UP)))
        if k < turn - 1:
            history.append({"role": "assistant", "content": answer})
    return _reference(processor, history)["input_ids"][0].tolist(), shown[hidden:]


@pytest.mark.parametrize("keep", [1, 2])
def test_colour_turns_prompts_equal_the_processors_encoding_of_the_truncated_conversation(tiny, keep):
    processor, descriptor = tiny
    store = ImageStore()
    encoder = PromptEncoder(processor, store, descriptor)
    examples = colour_turns.generate(3, 0, store)
    answer = "Red"
    engine = Scripted(encoder, encoder.tokenizer(answer, add_special_tokens=False)["input_ids"] + [encoder.stop_ids[0]])
    spec = vlmreg.get_environment_registry().get("colour_turns")
    reward = combine({"first_word": 1.0})
    trajectories = run_episodes(
        [(e, i) for i, e in enumerate(examples)],
        lambda e: spec.make(e, reward, store),
        engine,
        SamplingParams(),
        max_images_per_message=1,
        max_images_in_context=keep,
    )
    for example, trajectory in zip(examples, trajectories, strict=True):
        assert len(trajectory.turns) == colour_turns.TURNS
        for number, turn in enumerate(trajectory.turns, 1):
            want, kept = reference_ids(processor, store, example, number, keep, answer)
            assert turn.prompt_ids == want, f"turn {number}"
            assert turn.image_ids == kept and len(turn.image_ids) <= keep
            assert turn.budget_break == (keep < number)  # images dropped by this turn's reply: the prefix changed
        assert trajectory.images_over_budget == trajectory.images_dropped == max(0, colour_turns.TURNS - keep)
    # training samples are the sampled tokens exactly: split where the budget changed the prefix, each checked
    samples, stats = build_samples(trajectories, [1.0] * len(trajectories), seq_len=4096, check=encoder.check)
    per_episode = 1 + (colour_turns.TURNS - keep)
    assert len(samples) == per_episode * len(trajectories) and stats.prefix_breaks == 0
    assert stats.budget_splits == (per_episode - 1) * len(trajectories)
    sampled = {tuple(t.prompt_ids + t.completion_ids) for tr in trajectories for t in tr.turns}
    for sample in samples:
        assert tuple(sample.input_ids) in sampled and len(sample.image_ids) <= keep
        assert sample.loss_tokens % len(engine.answer) == 0


def test_a_long_episode_holds_at_most_k_images_per_turn_and_memory_stays_flat(tiny):
    """12 turns, a new image each, K = 2: every prompt and sample has at most 2 images, and the image tokens per
    prompt stop growing after turn 2 (only the text grows)."""
    processor, descriptor = tiny
    store = ImageStore()
    encoder = PromptEncoder(processor, store, descriptor)
    frames = [store.add(Image.new("RGB", (64, 64), (20 * k, 0, 0))) for k in range(12)]

    class Game:
        def __init__(self):
            self.turn = 0

        def reset(self, example):
            return list(example.messages)

        def step(self, completion):
            self.turn += 1
            if self.turn == len(frames):
                return EnvStep(reward=1.0, done=True)
            return EnvStep(reward=0.0, done=False, messages=[user(image_part(frames[self.turn]), text_part("next"))])

    example = Example("game:0", [user(image_part(frames[0]), text_part("go"))], answer=None)
    engine = Scripted(encoder, encoder.tokenizer("left", add_special_tokens=False)["input_ids"] + [encoder.stop_ids[0]])
    [trajectory] = run_episodes(
        [(example, 0)],
        lambda e: Game(),
        engine,
        SamplingParams(),
        max_images_per_message=1,
        max_images_in_context=2,
        max_turns=12,
    )
    image_tokens = [sum(e - s for s, e in turn.image_spans) for turn in trajectory.turns]
    assert [len(turn.image_ids) for turn in trajectory.turns] == [1] + [2] * 11
    assert image_tokens[1:] == [image_tokens[1]] * 11
    assert trajectory.images_over_budget == 10
    samples, _ = build_samples([trajectory], [1.0], seq_len=1 << 16, check=encoder.check)
    assert max(len(s.image_ids) for s in samples) == 2


def test_a_conversation_engine_gets_the_budgeted_messages():
    """Engines that render messages themselves (the OpenAI client) see the same budgeted conversation."""
    seen = []

    class ChatEngine:
        def chat(self, conversations, params, *, template_kwargs=None, names=None):
            seen.extend(conversations)

            return [
                ChatTurn(EncodedPrompt([1], [], [], ""), Completion([2], [-1.0], "stop"), "x") for _ in conversations
            ]

    class Game:
        def __init__(self):
            self.turn = 0

        def reset(self, example):
            return list(example.messages)

        def step(self, completion):
            self.turn += 1
            return EnvStep(
                reward=0.0, done=self.turn == 3, messages=[user(image_part(f"img{self.turn}"), text_part("next"))]
            )

    example = Example("g:0", [user(image_part("img0"), text_part("go"))], answer=None)
    run_episodes(
        [(example, 0)],
        lambda e: Game(),
        ChatEngine(),
        SamplingParams(),
        max_images_per_message=1,
        max_images_in_context=1,
    )
    assert [count_images(c) for c in seen] == [1, 1, 1]
    assert seen[-1][0]["content"][0] == text_part(IMAGE_MARKER) and seen[-1][-1]["content"][0] == image_part("img2")


def test_the_embedded_engine_trains_on_exactly_the_sampled_tokens_under_a_budget():
    torch.manual_seed(0)
    loaded = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}})
    )
    store = ImageStore()
    engine = EmbeddedEngine(loaded.model, loaded.processor, store, torch.device("cpu"))
    examples = colour_turns.generate(2, 1, store)
    reward = combine({"first_word": 1.0})
    spec = vlmreg.get_environment_registry().get("colour_turns")
    trajectories = run_episodes(
        [(e, 0) for e in examples],
        lambda e: spec.make(e, reward, store),
        engine,
        SamplingParams(max_tokens=4),
        max_images_per_message=1,
        max_images_in_context=1,
    )
    samples, stats = build_samples(trajectories, [1.0, 1.0], seq_len=4096, check=engine.encoder.check)
    sampled = [t.prompt_ids + t.completion_ids for tr in trajectories for t in tr.turns]
    assert [s.input_ids for s in samples] == sampled  # K = 1 and a new image each turn: every turn is its own sample
    assert stats.budget_splits == 4 and stats.prefix_breaks == 0
    assert all(len(s.image_ids) == 1 for s in samples)
