"""Images reach a rollout server at the size the trainer's processor resizes them to (`FamilyDescriptor.engine_image`).

vLLM loads a checkpoint's processor with ``AutoProcessor``, which takes transformers' torchvision backend where
torchvision is installed; its bicubic resize differs from the PIL backend the trainer uses (one uint8 level in about
0.5% of an odd-sized image's values: glm4v's logprobs through vLLM were 2.2-3.9e-3 apart in fp32). Sent already at the
target size, the server resizes nothing. Checked against the trainer's processor itself: its own grid says the target
size, and its tensors for the resized image equal those for the original (the trainer sees no change).
"""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

import vlmreg
from tests.inference.test_openai_client import Stub, answer, params
from vlmreg.config import parse_config
from vlmreg.data import ImageStore
from vlmreg.inference.openai_client import OpenAIEngine, RolloutServerError
from vlmreg.sdk import image_part, text_part
from vlmreg.sdk.registry import get_registry
from vlmreg.testing.parity import noise_image

HOOKED = sorted(name for name in get_registry().names() if get_registry().get(name).engine_image is not None)


def load(family: str):
    return vlmreg.load(parse_config({"model": {"init": "random", "family": family}, "trainer": {"device": "cpu"}}))


def test_the_families_whose_processor_resizes_declare_the_hook():
    assert {"qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl", "qwen2_vl", "qwen3_5", "qwen3_5_moe", "glm4v"} <= set(HOOKED)


@pytest.mark.parametrize("family", HOOKED)
def test_the_hook_gives_the_processor_s_target_size_and_changes_nothing_the_trainer_sees(family):
    loaded = load(family)
    processor, hook = loaded.processor, loaded.resolved.descriptor.engine_image
    patch = processor.image_processor.patch_size
    for seed, size in enumerate([(101, 67), (333, 190), (64, 64)]):
        image = noise_image(size, seed)
        sent = hook(processor, image)
        own = processor.image_processor(images=[image], return_tensors="pt")
        _, rows, cols = (int(v) for v in own["image_grid_thw"][0])
        assert (sent.height, sent.width) == (rows * patch, cols * patch), (family, size)
        again = processor.image_processor(images=[sent], return_tensors="pt")
        assert all(torch.equal(own[k], again[k]) for k in own), (family, size)
        assert hook(processor, sent) is sent  # already at the target size: not resized again


def test_the_openai_engine_sends_the_resized_image():
    loaded = load("qwen3_vl")
    store = ImageStore()
    odd = store.add(noise_image((101, 67), 0))
    stub = Stub([(200, answer([10, 11, 12], [40]))])
    try:
        client = OpenAIEngine(stub.url, loaded.processor, store, model="m", descriptor=loaded.resolved.descriptor)
        with pytest.raises(RolloutServerError):  # the canned answer holds no image tokens; the request is what counts
            client.chat([[{"role": "user", "content": [image_part(odd), text_part("colour?")]}]], params(loaded))
    finally:
        stub.close()
    url = stub.requests[0]["messages"][0]["content"][0]["image_url"]["url"]
    sent = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    grid = loaded.processor.image_processor(images=[store.get(odd)], return_tensors="pt")["image_grid_thw"][0]
    patch = loaded.processor.image_processor.patch_size
    assert sent.size == (int(grid[2]) * patch, int(grid[1]) * patch) != store.get(odd).size
