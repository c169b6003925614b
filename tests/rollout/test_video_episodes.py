"""Videos in multi-turn episodes: a video re-shown each turn is stored once, its prompts are the processor's own
encoding, the turns merge into one training sample, and the video budget keeps the last K videos."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import vlmreg
from vlmreg.config import parse_config
from vlmreg.data import ImageStore
from vlmreg.data.prompts import PromptEncoder, template_messages
from vlmreg.data.store import video_inputs
from vlmreg.data.video import DecodedVideo
from vlmreg.inference.embedded import EmbeddedEngine
from vlmreg.rollout.episodes import run_episodes
from vlmreg.rollout.image_budget import VIDEO_MARKER, apply_media_budget
from vlmreg.sdk.engine import Completion, SamplingParams
from vlmreg.sdk.environment import EnvStep
from vlmreg.sdk.example import Example, text_part
from vlmreg.sdk.video import video_part
from vlmreg.train.samples import build_samples

TURNS = 4


def user(*parts):
    return {"role": "user", "content": list(parts)}


class Scripted:
    """A token-prompt engine answering every prompt with the same tokens."""

    def __init__(self, encoder, answer):
        self.encoder, self.answer = encoder, answer

    def complete(self, prompts, params):
        return [Completion(list(self.answer), [-1.0] * len(self.answer), "stop") for _ in prompts]


class Rewatch:
    """Shows the same video again after every answer, for `TURNS` turns."""

    def __init__(self, video_id):
        self.video_id, self.turn = video_id, 0

    def reset(self, example):
        return list(example.messages)

    def step(self, completion):
        self.turn += 1
        if self.turn == TURNS:
            return EnvStep(reward=1.0, done=True)
        return EnvStep(reward=0.0, done=False, messages=[user(video_part(self.video_id), text_part("again?"))])


@pytest.fixture(scope="module")
def loaded():
    torch.manual_seed(0)
    return vlmreg.load(parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}}))


def test_a_four_turn_episode_reshowing_a_sixteen_frame_video_stores_sixteen_frames(loaded):
    store = ImageStore()
    frames = tuple(Image.new("RGB", (32, 32), (15 * k, 255 - 15 * k, 0)) for k in range(16))
    video_id = store.add_video(DecodedVideo(frames, 4.0, 16, tuple(range(16))))
    encoder = PromptEncoder(loaded.processor, store, loaded.resolved.descriptor)
    engine = EmbeddedEngine(loaded.model, loaded.processor, store, loaded.device, descriptor=loaded.resolved.descriptor)
    example = Example("watch:0", [user(video_part(video_id), text_part("which colour?"))], answer=None)
    params = SamplingParams(max_tokens=3, stop_token_ids=encoder.stop_ids, suppress_token_ids=())
    [trajectory] = run_episodes(
        [(example, 0)],
        lambda e: Rewatch(video_id),
        engine,
        params,
        max_images_per_message=1,
        max_turns=TURNS,
        max_videos_per_message=1,
    )
    assert len(trajectory.turns) == TURNS and len(store) == 16 and store.video_count == 1
    assert trajectory.turns[-1].image_ids == [video_id] * TURNS
    samples, stats = build_samples([trajectory], [1.0], seq_len=1 << 16, check=encoder.check)
    assert len(samples) == 1 and stats.merged_turns == TURNS - 1 and samples[0].image_ids == [video_id] * TURNS
    # the same episode answered "Red" each turn: the last prompt is the processor's own encoding of the conversation
    answer = encoder.tokenizer("Red", add_special_tokens=False)["input_ids"] + [encoder.stop_ids[0]]
    [scripted] = run_episodes(
        [(example, 0)],
        lambda e: Rewatch(video_id),
        Scripted(encoder, answer),
        params,
        max_images_per_message=1,
        max_turns=TURNS,
        max_videos_per_message=1,
    )
    history = []
    for k in range(TURNS):
        history.append(user({"type": "video", "video": "v"}, text_part("which colour?" if k == 0 else "again?")))
        if k < TURNS - 1:
            history.append({"role": "assistant", "content": "Red"})
    chat, _ = template_messages(history)
    text = loaded.processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    one = video_inputs(store.video(video_id), frames)
    media = {
        "videos": one["videos"] * TURNS,
        "video_metadata": one["video_metadata"] * TURNS,
        "do_sample_frames": False,
    }
    want = loaded.processor(text=[text], **media, return_tensors="pt")["input_ids"][0].tolist()
    assert scripted.turns[-1].prompt_ids == want and len(store) == 16


def test_the_video_budget_keeps_the_last_k_videos_and_images_apart():
    messages = [
        user(video_part("video:a"), text_part("one")),
        user(video_part("video:b"), {"type": "image", "image": "i"}),
    ]
    kept, images, videos = apply_media_budget(messages, None, 1)
    assert (images, videos) == (0, 1)
    assert kept[0]["content"] == [text_part(VIDEO_MARKER), text_part("one")] and kept[1] == messages[1]
    assert apply_media_budget(messages, 1, None) == (messages, 0, 0)


def test_max_videos_in_context_keeps_the_last_video_of_a_rewatch_episode(loaded):
    store = ImageStore()
    frames = tuple(Image.new("RGB", (32, 32), (0, 0, 20 * k)) for k in range(4))
    video_id = store.add_video(DecodedVideo(frames, 2.0, 4, tuple(range(4))))
    encoder = PromptEncoder(loaded.processor, store, loaded.resolved.descriptor)
    answer = encoder.tokenizer("Red", add_special_tokens=False)["input_ids"] + [encoder.stop_ids[0]]
    example = Example("watch:0", [user(video_part(video_id), text_part("which colour?"))], answer=None)
    [trajectory] = run_episodes(
        [(example, 0)],
        lambda e: Rewatch(video_id),
        Scripted(encoder, answer),
        SamplingParams(),
        max_images_per_message=1,
        max_turns=TURNS,
        max_videos_in_context=1,
    )
    assert [len(turn.image_ids) for turn in trajectory.turns] == [1] * TURNS
    assert trajectory.videos_dropped == TURNS - 1 and trajectory.images_dropped == 0
    assert [turn.budget_break for turn in trajectory.turns] == [False] + [True] * (TURNS - 1)
    assert encoder.tokenizer.decode(trajectory.turns[-1].prompt_ids).count(VIDEO_MARKER) == TURNS - 1
