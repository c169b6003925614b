"""A micro-batch's pixels go to the GPU per image from pinned memory and are joined there (`collate_on_device`).

The reference is `pad_and_concat` on the host (the collation every family without its own uses), moved to the device
afterwards: the same values, dtypes, shapes and keys in the same order. Needs CUDA (pinned memory); the host-side
rules (a family's own collation stays on the host) are checked without it.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from PIL import Image

import vlmreg
from vlmreg.config import parse_config
from vlmreg.data import ImageStore
from vlmreg.data.prompts import PromptEncoder
from vlmreg.data.store import collate_on_device, pad_and_concat
from vlmreg.data.video import DecodedVideo

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory, a device to collate on)")


def encoder_with_media(pin: bool, collate=None):
    loaded = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}})
    )
    store = ImageStore(pin_memory=pin)
    descriptor = loaded.resolved.descriptor
    if collate is not None:
        descriptor = attrs.evolve(descriptor, collate_images=collate)
    encoder = PromptEncoder(loaded.processor, store, descriptor)
    ids = [store.add(Image.new("RGB", size, colour)) for size, colour in (((64, 64), "red"), ((96, 64), "blue"))]
    ids.append(ids[0])  # a repeat
    frames = tuple(Image.new("RGB", (64, 64), c) for c in ("red", "red", "blue", "blue"))
    ids.append(store.add_video(DecodedVideo(frames, 2.0, 4, (0, 1, 2, 3))))
    return encoder, ids


@CUDA
def test_pixels_joined_on_the_device_equal_the_host_collation():
    encoder, ids = encoder_with_media(pin=True)
    assert all(t.is_pinned() for i in ids for t in encoder.image(i).tensors.values() if t.is_floating_point()), (
        "ImageStore(pin_memory=True) keeps each image's pixels pinned"
    )
    device = torch.device("cuda")
    got = encoder.image_inputs(ids, device=device)
    want = encoder.image_inputs(ids)  # the host collation
    assert list(got) == list(want)
    for key, value in want.items():
        on_device = got[key].is_cuda
        assert on_device == value.is_floating_point(), key  # pixels on the GPU, grids on the host
        assert got[key].dtype == value.dtype and torch.equal(got[key].cpu(), value), key


@CUDA
def test_an_unpinned_image_is_pinned_on_the_way():
    parts = [{"pixel_values": torch.rand(4, 6), "grid": torch.tensor([[1, 2, 2]])} for _ in range(2)]
    got = collate_on_device(parts, torch.device("cuda"))
    want = pad_and_concat(parts)
    assert got["pixel_values"].is_cuda and not got["grid"].is_cuda
    assert torch.equal(got["pixel_values"].cpu(), want["pixel_values"]) and torch.equal(got["grid"], want["grid"])


def test_a_family_that_collates_its_own_way_collates_on_the_host():
    calls = []
    encoder, ids = encoder_with_media(pin=False, collate=lambda per_image: calls.append(1) or pad_and_concat(per_image))
    got = encoder.image_inputs(ids, device=torch.device("cuda"))  # no CUDA needed: nothing goes there
    assert calls, "the family's own collation was not used"
    want = encoder.image_inputs(ids)
    assert list(got) == list(want)
    assert all(not got[k].is_cuda and torch.equal(got[k], want[k]) for k in want)


def test_without_pinning_the_store_keeps_the_processor_tensors():
    encoder, ids = encoder_with_media(pin=False)
    assert not any(t.is_pinned() for i in ids for t in encoder.image(i).tensors.values())
