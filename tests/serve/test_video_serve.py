"""`vlmreg serve` takes OpenAI/vLLM ``video_url`` parts: the prompt is the processor's own encoding of the sampled
frames, the logprobs those of a plain forward; a family without video, and too many videos, are 400s naming the
field."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

import vlmreg
from tests.data.test_video import mp4_bytes
from tests.inference.test_openai_client import params
from tests.serve.test_server import post
from vlmreg.config import parse_config
from vlmreg.data import ImageStore
from vlmreg.data.images import ImageLimits
from vlmreg.data.prompts import template_messages, vision_token_ids
from vlmreg.data.store import StoredVideo, video_inputs
from vlmreg.data.video import DecodedVideo, VideoLimits, decode_video
from vlmreg.inference.embedded import EmbeddedEngine
from vlmreg.inference.openai_client import OpenAIEngine
from vlmreg.sdk.video import VideoSampling
from vlmreg.serve import serve_in_thread
from vlmreg.serve.protocol import RequestError, ServeLimits, parse_chat_request

URI = "data:video/mp4;base64," + base64.b64encode(mp4_bytes()).decode()


@pytest.fixture(scope="module")
def served():
    torch.manual_seed(0)
    config = {
        "model": {"init": "random", "family": "qwen3_vl"},
        "trainer": {"device": "cpu"},
        "data": {"task": "colour", "video_fps": 2.0},
    }
    loaded = vlmreg.load(parse_config(config))
    server, url = serve_in_thread(loaded)
    yield loaded, url
    server.close()


def test_a_video_request_gets_the_processors_prompt_and_a_plain_forwards_logprobs(served):
    loaded, url = served
    message = {
        "role": "user",
        "content": [{"type": "video_url", "video_url": {"url": URI}}, {"type": "text", "text": "What colour?"}],
    }
    status, body = post(
        url, {"messages": [message], "max_tokens": 5, "logprobs": True, "return_token_ids": True, "temperature": 0.8}
    )
    assert status == 200, body
    video = decode_video(URI, limits=VideoLimits(), sampling=VideoSampling(fps=2.0, max_frames=32), where="")
    assert video.frame_indices == (0, 2, 5, 7)
    media = video_inputs(StoredVideo((), video.fps, video.total_frames, video.frame_indices), video.frames)
    chat, _ = template_messages(
        [{"role": "user", "content": [{"type": "video", "video": "v"}, {"type": "text", "text": "What colour?"}]}]
    )
    text = loaded.processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = body["choices"][0]["token_ids"]
    reference = loaded.processor(text=[text + loaded.processor.tokenizer.decode(ids)], **media, return_tensors="pt")
    reference.pop("video_metadata", None)
    prompt = body["prompt_token_ids"]
    assert prompt == reference["input_ids"][0, : len(prompt)].tolist()
    assert "seconds>" in loaded.processor.tokenizer.decode(prompt)
    with torch.no_grad():
        logits = loaded.model(**reference, use_cache=False).logits[0, len(prompt) - 1 : -1].float() / 0.8
    logits[:, list(vision_token_ids(loaded.processor, loaded.resolved.descriptor))] = float("-inf")
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
    got = torch.tensor([entry["logprob"] for entry in body["choices"][0]["logprobs"]["content"]])
    assert torch.allclose(expected, got, atol=1e-4)


def test_too_many_videos_and_a_bad_video_are_400s_naming_the_field(served):
    _, url = served
    part = {"type": "video_url", "video_url": {"url": URI}}
    status, body = post(url, {"messages": [{"role": "user", "content": [part] * 5}]})
    assert (
        status == 400 and "carries 5 videos; the model's family takes at most 4 per message" in body["error"]["message"]
    )
    bad = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"junk").decode()}}
    status, body = post(url, {"messages": [{"role": "user", "content": [bad]}]})
    assert (
        status == 400
        and body["error"]["param"] == "messages[0].content[0].video_url"
        and "not a video" in body["error"]["message"]
    )


def test_a_family_without_video_refuses_a_video_url_naming_itself():
    limits = ServeLimits("m", 8, 4, 1, ImageLimits(), family="gemma3")
    request = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": URI}}]}]}
    with pytest.raises(RequestError, match="the model's family gemma3 takes no video input"):
        parse_chat_request(request, limits)


def test_the_openai_engine_s_video_frames_get_the_embedded_engine_s_prompt_and_answer(served):
    """`OpenAIEngine` sends a stored video as vLLM's frame list (PNG frames, the timing in ``media_io_kwargs``); vlmreg
    serve reads it back to the same frames and timing, so prompt and greedy answer are the embedded engine's."""
    loaded, url = served
    store = ImageStore()
    frames = tuple(Image.new("RGB", (90, 70), c) for c in ("red", "red", "blue", "green", "green"))  # resized: 64x96
    video_id = store.add_video(DecodedVideo(frames, 10.0, 50, (0, 12, 25, 37, 49)))
    conversation = [{"role": "user", "content": [{"type": "video", "video": video_id}, {"type": "text", "text": "?"}]}]
    client = OpenAIEngine(url, loaded.processor, store, descriptor=loaded.resolved.descriptor)
    embedded = EmbeddedEngine(
        loaded.model, loaded.processor, store, torch.device("cpu"), descriptor=loaded.resolved.descriptor
    )
    greedy = params(loaded, greedy=True)
    [remote], [local] = client.chat([conversation], greedy), embedded.chat([conversation], greedy)
    assert remote.prompt == local.prompt
    assert "<3.1 seconds>" in loaded.processor.tokenizer.decode(remote.prompt.input_ids)  # (25 + 37) / 2 / 10 fps
    assert remote.completion.token_ids == local.completion.token_ids
    assert remote.completion.logprobs == pytest.approx(local.completion.logprobs, abs=1e-4)


def test_a_frame_list_s_timing_is_checked_naming_the_field():
    limits = ServeLimits("m", 8, 4, 1, ImageLimits(), family="qwen3_vl", max_videos_per_message=1)
    frame = base64.b64encode(mp4_frame_png()).decode()
    part = {"type": "video_url", "video_url": {"url": f"data:video/jpeg;base64,{frame},{frame}"}}
    request = {"messages": [{"role": "user", "content": [part]}]}
    parsed = parse_chat_request(
        {**request, "media_io_kwargs": {"video": {"fps": 2.0, "frames_indices": [0, 3], "total_num_frames": 4}}}, limits
    )
    video = parsed.messages[0]["content"][0]["video"]
    assert (len(video.frames), video.fps, video.total_frames, video.frame_indices) == (2, 2.0, 4, (0, 3))
    for timing, field, words in (
        ({"frames_indices": [0]}, "media_io_kwargs.video.frames_indices", "1 entries for the 2 frames"),
        ({"total_num_frames": 1}, "media_io_kwargs.video.total_num_frames", "fewer than the 2 frames"),
        ({"do_sample_frames": True}, "media_io_kwargs.video.do_sample_frames", "the frames sent are the sampled ones"),
        ({"fps": "fast"}, "media_io_kwargs.video.fps", "a positive number"),
        ({"seek": 1}, "media_io_kwargs.video.seek", "is not supported"),
    ):
        with pytest.raises(RequestError) as caught:
            parse_chat_request({**request, "media_io_kwargs": {"video": timing}}, limits)
        assert caught.value.param == field and words in str(caught.value), (timing, caught.value)
    mp4 = {"type": "video_url", "video_url": {"url": URI}}
    with pytest.raises(RequestError, match="applies to frame lists"):
        parse_chat_request(
            {"messages": [{"role": "user", "content": [mp4]}], "media_io_kwargs": {"video": {"fps": 2}}}, limits
        )


def mp4_frame_png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buffer, format="PNG")
    return buffer.getvalue()
