"""`vlmreg serve` takes OpenAI/vLLM ``video_url`` parts: the prompt is the processor's own encoding of the sampled
frames, the logprobs those of a plain forward; a family without video, and too many videos, are 400s naming the
field."""

from __future__ import annotations

import base64

import pytest
import torch

import vlmreg
from tests.data.test_video import mp4_bytes
from tests.serve.test_server import post
from vlmreg.config import parse_config
from vlmreg.data.images import ImageLimits
from vlmreg.data.prompts import template_messages, vision_token_ids
from vlmreg.data.store import StoredVideo, video_inputs
from vlmreg.data.video import VideoLimits, decode_video
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
    limits = ServeLimits("m", 8, 4, 1, ImageLimits(), family="qwen2_vl")
    request = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": URI}}]}]}
    with pytest.raises(RequestError, match="the model's family qwen2_vl takes no video input"):
        parse_chat_request(request, limits)
