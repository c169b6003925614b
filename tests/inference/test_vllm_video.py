"""Videos through vLLM: the request `OpenAIEngine` sends, read back the way vLLM 0.24 reads it, gives vLLM the trainer's
frames (bitwise), the trainer's timing, and a prompt that is the family's processor's own, token for token.

`vllm_reading` is written from vLLM 0.24.0's source, not from vlmreg's: ``MediaConnector._load_data_url``
(``data:<type>;base64,<data>``), ``VideoMediaIO.load_base64`` for ``video/jpeg`` (comma-separated frames, each opened by
PIL; ``num_frames`` of them; the metadata from ``media_io_kwargs["video"]``; a request's keys over the server's, and
with both ``fps`` and ``num_frames`` given neither is dropped: ``VideoMediaIO.merge_kwargs``), and Qwen3-VL's multimodal
processor (``Qwen3VLProcessingInfo._calculate_timestamps``: the mean of each temporal pair's frame indices over ``fps``,
the last index repeated to fill the pair; ``get_video_repl``: per frame group ``tokenizer.encode(f"<{t:.1f} seconds>")``
then vision start, the group's video tokens, vision end; ``_replace_video_token_placeholders``: the first
``<|vision_start|><|video_pad|><|vision_end|>`` of the templated prompt replaced by that whole sequence); Qwen2-VL's
and Qwen2.5-VL's (``Qwen2VLMultiModalProcessor._get_prompt_updates``: the template's ``<|video_pad|>`` alone replaced by
``grid_thw.prod() // merge_size**2`` pads, no timestamps). The same functions of vLLM itself gave the same prompt ids
for Qwen3-VL on this machine (docs/serving.md). The references are the family's
processor given the stored frames and their metadata (`transformers.video_utils.VideoMetadata`) and its own chat
template.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from PIL import Image
from transformers.video_utils import VideoMetadata

import vlmreg
from tests.inference.test_openai_client import Stub, answer
from vlmreg.config import parse_config
from vlmreg.data import ImageStore
from vlmreg.data.video import DecodedVideo
from vlmreg.inference.openai_client import OpenAIEngine, RolloutServerError
from vlmreg.sdk.engine import SamplingParams
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_registry

VIDEO_FAMILIES = sorted(n for n in get_registry().names() if get_registry().get(n).max_videos_per_message)
#: model types whose vLLM 0.24 multimodal processor is Qwen2-VL's (qwen2_vl.py, qwen2_5_vl.py): the pad alone replaced
VLLM_PAD_ONLY = {"qwen2_vl", "qwen2_5_vl"}
LOADED: dict[str, Any] = {}


def load(family: str) -> Any:
    if family not in LOADED:
        config = {"model": {"init": "random", "family": family}, "trainer": {"device": "cpu"}}
        LOADED[family] = vlmreg.load(parse_config(config))
    return LOADED[family]


def clip(count: int, size: tuple[int, int], seed: int = 0) -> tuple[Image.Image, ...]:
    rng = np.random.default_rng(seed)
    return tuple(Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(count))


# -- vLLM 0.24, as its source reads (see the module docstring) --------------------------------------------------------
def vllm_reading(
    request: dict, tokenizer: Any, grid_of: Any, server_defaults: dict | None = None, pad_only: bool = False
) -> dict:
    """What vLLM 0.24 makes of a chat request's single video: its frames, metadata, timestamps and prompt ids.
    ``grid_of(frames, metadata)``: the (t, h, w) grid the HF video processor gives the frames vLLM decoded;
    ``pad_only``: the Qwen2-VL prompt update (the pad replaced, no timestamps) instead of Qwen3-VL's."""
    parts = request["messages"][0]["content"]
    [video] = [p for p in parts if p["type"] == "video_url"]
    spec, data = video["video_url"]["url"][5:].split(",", 1)
    media_type, encoding = spec.split(";", 1)
    assert (media_type, encoding) == ("video/jpeg", "base64")
    kwargs = {**(server_defaults or {}), **request["media_io_kwargs"]["video"]}
    count = kwargs.get("num_frames", 32)
    frames = np.stack(
        [
            np.asarray(Image.open(io.BytesIO(base64.b64decode(piece, validate=True))).convert("RGB"))
            for piece in data.split(",", count)[:count]
        ]
    )
    metadata = {
        "total_num_frames": kwargs.get("total_num_frames", len(frames)),
        "fps": float(kwargs.get("fps", 1)),
        "duration": kwargs.get("duration"),
        "frames_indices": kwargs.get("frames_indices", list(range(len(frames)))),
        "do_sample_frames": kwargs.get("do_sample_frames", False),
    }
    t, h, w = grid_of(frames, metadata)
    pair = 2  # the temporal patch
    indices = list(metadata["frames_indices"])
    indices += [indices[-1]] * (-len(indices) % pair)
    seconds = [(indices[i] + indices[i + pair - 1]) / 2 / metadata["fps"] for i in range(0, len(indices), pair)]
    start, pad, end = (
        tokenizer.convert_tokens_to_ids(s) for s in ("<|vision_start|>", "<|video_pad|>", "<|vision_end|>")
    )
    expansion: list[int] = []
    for second in seconds:
        expansion += tokenizer.encode(f"<{second:.1f} seconds>", add_special_tokens=False)
        expansion += [start, *[pad] * (h * w // 4), end]
    assert len(seconds) == t
    if pad_only:
        expansion = [pad] * (t * h * w // 4)
    chat = [
        {
            "role": m["role"],
            "content": [
                {"type": "video"} if p["type"] == "video_url" else {"type": "text", "text": p["text"]}
                for p in m["content"]
            ],
        }
        for m in request["messages"]
    ]
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    at = next(i for i in range(len(ids) - 2) if ids[i : i + 3] == [start, pad, end])
    if pad_only:
        return {"frames": frames, "metadata": metadata, "prompt_ids": [*ids[: at + 1], *expansion, *ids[at + 2 :]]}
    return {"frames": frames, "metadata": metadata, "prompt_ids": [*ids[:at], *expansion, *ids[at + 3 :]]}


def processor_reference(processor: Any, messages: list, frames: list, fps: float, total: int, indices: list) -> dict:
    """The family's processor on the stored frames and their metadata, with its own chat template."""
    metadata = VideoMetadata(
        total_num_frames=total,
        fps=fps,
        width=frames[0].width,
        height=frames[0].height,
        duration=total / fps,
        frames_indices=list(indices),
    )
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    array = np.stack([np.asarray(f, dtype=np.uint8) for f in frames])
    return processor(
        text=[text], videos=[array], video_metadata=[metadata], do_sample_frames=False, return_tensors="pt"
    )


def grid_with(processor: Any) -> Any:
    def grid_of(frames: np.ndarray, metadata: dict) -> tuple[int, int, int]:
        meta = VideoMetadata(
            total_num_frames=metadata["total_num_frames"],
            fps=metadata["fps"],
            frames_indices=metadata["frames_indices"],
        )
        out = processor.video_processor(
            videos=[frames], video_metadata=[meta], do_sample_frames=False, return_tensors="pt"
        )
        return tuple(int(v) for v in out["video_grid_thw"][0])

    return grid_of


def engine_for(loaded: Any, store: ImageStore, url: str = "http://127.0.0.1:9", **kwargs: Any) -> OpenAIEngine:
    return OpenAIEngine(url, loaded.processor, store, model="m", descriptor=loaded.resolved.descriptor, **kwargs)


def video_conversation(video_id: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Watch:"},
                {"type": "video", "video": video_id},
                {"type": "text", "text": "What moved?"},
            ],
        }
    ]


def request_for(engine: OpenAIEngine, conversation: list[dict]) -> dict:
    return engine._payload(conversation, SamplingParams(max_tokens=4), None, "m", {})


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
# a clip the processor resizes; an odd frame count (the last temporal patch padded); more frames than vLLM's default
# num_frames (32), which the request must lift
@pytest.mark.parametrize(
    ("count", "size", "fps", "total"), [(6, (90, 70), 10.0, 50), (5, (64, 64), 2.0, 5), (40, (32, 32), 4.0, 40)]
)
def test_vllm_reads_the_trainers_frames_timing_and_prompt(family, count, size, fps, total):
    loaded = load(family)
    processor = loaded.processor
    store = ImageStore()
    frames = clip(count, size)
    indices = tuple(round(i * (total - 1) / (count - 1)) for i in range(count))
    video_id = store.add_video(DecodedVideo(frames, fps, total, indices))
    request = request_for(engine_for(loaded, store, server="vllm"), video_conversation(video_id))
    read = vllm_reading(
        request,
        processor.tokenizer,
        grid_with(processor),
        server_defaults={"num_frames": 32, "fps": 1},
        pad_only=loaded.model.config.model_type in VLLM_PAD_ONLY,
    )
    # the timing vLLM's processor gets is the trainer's
    assert read["metadata"] == {
        "total_num_frames": total,
        "fps": fps,
        "duration": total / fps,
        "frames_indices": list(indices),
        "do_sample_frames": False,
    }
    # the frames: the processor's target size (nothing left for vLLM's processor to resize), and the trainer's pixels
    reference = processor_reference(
        processor,
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Watch:"},
                    {"type": "video"},
                    {"type": "text", "text": "What moved?"},
                ],
            }
        ],
        list(frames),
        fps,
        total,
        indices,
    )
    _, rows, cols = (int(v) for v in reference["video_grid_thw"][0])
    patch = processor.video_processor.patch_size
    assert read["frames"].shape == (count, rows * patch, cols * patch, 3)
    decoded = processor_reference(
        processor,
        [{"role": "user", "content": [{"type": "video"}]}],
        [Image.fromarray(f) for f in read["frames"]],
        fps,
        total,
        indices,
    )
    assert torch.equal(decoded["pixel_values_videos"], reference["pixel_values_videos"])
    assert torch.equal(decoded["video_grid_thw"], reference["video_grid_thw"])
    # the prompt: the processor's own ids, timestamps and markup included
    assert read["prompt_ids"] == reference["input_ids"][0].tolist()


def test_without_the_wrapper_vllm_s_prompt_lacks_the_processor_s_outer_markup():
    """Why qwen3_vl declares ``vllm_video_wrapper``: vLLM 0.24 replaces the template's whole video markup, transformers
    5 only the pad, so a plain video part gives vLLM a prompt two tokens short of the processor's."""
    loaded = load("qwen3_vl")
    processor = loaded.processor
    store = ImageStore()
    video_id = store.add_video(DecodedVideo(clip(4, (64, 64)), 4.0, 4, (0, 1, 2, 3)))
    plain = attrs.evolve(loaded.resolved.descriptor, vllm_video_wrapper=None)
    engine = OpenAIEngine("http://127.0.0.1:9", processor, store, model="m", descriptor=plain, server="vllm")
    read = vllm_reading(request_for(engine, video_conversation(video_id)), processor.tokenizer, grid_with(processor))
    want = engine.prompts.encode(video_conversation(video_id)).input_ids
    start, end = (processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    assert len(read["prompt_ids"]) == len(want) - 2
    first, last = want.index(start), len(want) - 1 - want[::-1].index(end)  # the processor's outer pair
    assert [t for i, t in enumerate(want) if i not in (first, last)] == read["prompt_ids"]


def test_a_video_answer_is_taken_when_its_prompt_is_the_trainers_and_refused_otherwise():
    loaded = load("qwen3_vl")
    store = ImageStore()
    video_id = store.add_video(DecodedVideo(clip(4, (80, 48)), 8.0, 16, (0, 5, 10, 15)))
    conversation = video_conversation(video_id)
    probe = engine_for(loaded, store, server="vllm")
    read = vllm_reading(request_for(probe, conversation), loaded.processor.tokenizer, grid_with(loaded.processor))
    params = SamplingParams(max_tokens=2)
    group = answer(read["prompt_ids"], [40, 41])
    group["choices"] = [{**group["choices"][0], "index": i} for i in range(3)]
    stub = Stub([(200, group)])
    try:
        turn = engine_for(loaded, store, url=stub.url, server="vllm").chat([conversation] * 3, params)[0]
    finally:
        stub.close()
    assert len(stub.requests) == 1 and stub.requests[0]["n"] == 3  # a group's identical video prompts: one request
    [(start, end)] = turn.prompt.image_spans
    assert turn.prompt.input_ids == read["prompt_ids"]
    assert tuple(read["prompt_ids"][start:end]) == probe.prompts.image(video_id).token_ids
    chat = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Watch:"}, {"type": "video"}, {"type": "text", "text": "What moved?"}],
        }
    ]
    assert turn.prompt.text == loaded.processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    short = [t for i, t in enumerate(read["prompt_ids"]) if i != start - 7]  # a server that drops a token before it
    stub = Stub([(200, answer(short, [40]))])
    try:
        with pytest.raises(RolloutServerError, match="not the trainer's processor's: token"):
            engine_for(loaded, store, url=stub.url, server="vllm").chat([conversation], params)
    finally:
        stub.close()


def test_vlmreg_serve_gets_no_wrapper_and_one_request_s_videos_share_their_timing():
    loaded = load("qwen3_vl")
    store = ImageStore()
    slow = store.add_video(DecodedVideo(clip(4, (64, 64)), 4.0, 4, (0, 1, 2, 3)))
    fast = store.add_video(DecodedVideo(clip(4, (64, 64), seed=1), 8.0, 8, (0, 2, 5, 7)))
    to_vlmreg = request_for(engine_for(loaded, store), video_conversation(slow))  # rollout.server = "vlmreg"
    assert [p["type"] for p in to_vlmreg["messages"][0]["content"]] == ["text", "video_url", "text"]
    assert to_vlmreg["media_io_kwargs"]["video"]["fps"] == 4.0
    both = [{"role": "user", "content": [{"type": "video", "video": slow}, {"type": "video", "video": fast}]}]
    with pytest.raises(VlmregError, match="one set of media_io_kwargs"):
        request_for(engine_for(loaded, store, server="vllm"), both)
    again = [{"role": "user", "content": [{"type": "video", "video": slow}, {"type": "video", "video": slow}]}]
    request = request_for(engine_for(loaded, store, server="vllm"), again)
    assert request["media_io_kwargs"]["video"]["frames_indices"] == [0, 1, 2, 3]


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_the_engine_video_hook_gives_the_processors_target_size_and_changes_nothing_the_trainer_sees(family):
    loaded = load(family)
    processor, hook = loaded.processor, loaded.resolved.descriptor.engine_video
    patch = processor.video_processor.patch_size
    for seed, (count, size) in enumerate([(4, (101, 67)), (3, (64, 64)), (6, (200, 120))]):
        frames = list(clip(count, size, seed))
        sent = hook(processor, frames)
        own = processor.video_processor(
            videos=[np.stack([np.asarray(f) for f in frames])], do_sample_frames=False, return_tensors="pt"
        )
        _, rows, cols = (int(v) for v in own["video_grid_thw"][0])
        assert all((f.height, f.width) == (rows * patch, cols * patch) for f in sent), (family, size)
        again = processor.video_processor(
            videos=[np.stack([np.asarray(f) for f in sent])], do_sample_frames=False, return_tensors="pt"
        )
        assert all(torch.equal(own[k], again[k]) for k in ("pixel_values_videos", "video_grid_thw")), (family, size)
        resent = hook(processor, sent)
        assert all(a is b for a, b in zip(resent, sent, strict=True))  # at the target size already: not resized again
