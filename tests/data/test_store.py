"""`ImageStore`: ids by content, features equal to the processor's own output for the image, a cache bounded in bytes.

References: PIL's own pixels (equal content, equal id), the family's processor called directly on the image with
its placeholder, and byte counts computed from the tensors' sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image

import vlmreg
from vlmreg.data import ImageStore
from vlmreg.data.prompts import image_placeholder
from vlmreg.data.store import image_id_of, pad_and_concat, pad_token_id, process_image, token_aligned_keys
from vlmreg.testing.parity import noise_image


@pytest.fixture(scope="module")
def qwen():
    descriptor = vlmreg.get_family("qwen3_vl")
    processor = descriptor.tiny_processor()
    return image_placeholder(processor, descriptor), processor


def test_ids_follow_content_and_size_not_the_object():
    red = Image.new("RGB", (4, 6), "red")
    assert image_id_of(red) == image_id_of(Image.new("RGB", (4, 6), (255, 0, 0)))
    assert image_id_of(red) != image_id_of(Image.new("RGB", (6, 4), "red"))  # the same bytes, another shape
    assert image_id_of(red) != image_id_of(Image.new("RGB", (4, 6), (254, 0, 0)))
    assert len(image_id_of(red)) == 24


def test_add_converts_to_rgb_and_keeps_one_copy_per_content():
    store = ImageStore()
    grey = Image.new("L", (8, 8), 128)
    a = store.add(grey)
    assert a == image_id_of(grey.convert("RGB")) and store.get(a).mode == "RGB"
    first = store.get(a)
    assert store.add(grey.convert("RGB")) == a and store.get(a) is first and len(store) == 1
    b = store.add(Image.new("RGB", (2, 3), "blue"))
    assert len(store) == 2 and a in store and b in store and "nope" not in store
    assert store.image_bytes == 3 * (8 * 8 + 2 * 3)
    with pytest.raises(KeyError, match="image 'nope' is not in the image store"):
        store.get("nope")


def test_features_are_the_processors_output_for_the_image_alone(qwen):
    placeholder, processor = qwen
    image = noise_image((64, 96), 1)
    store = ImageStore()
    image_id = store.add(image)
    features = store.features(image_id, processor, placeholder)
    out = processor(text=[placeholder], images=[image], add_special_tokens=False, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    assert list(features.token_ids) == ids and features.tokens == len(ids)  # qwen's expansion is all added tokens
    assert features.text_before == features.text_after == ""
    assert set(features.tensors) == {k for k in out if k not in ("input_ids", "attention_mask", *features.token_inputs)}
    for key, value in features.tensors.items():
        assert torch.equal(value, out[key]), key
    for key, values in features.token_inputs.items():
        assert list(values) == out[key][0].tolist(), key
    assert features.nbytes == sum(out[k].element_size() * out[k].nelement() for k in features.tensors) > 0
    assert store.features(image_id, processor, placeholder) is features and store.feature_computations == 1
    assert store.feature_bytes == features.nbytes


def test_the_feature_cache_is_bounded_in_bytes_least_recently_used_first(qwen):
    placeholder, processor = qwen
    images = [noise_image((64, 64), seed) for seed in range(3)]
    probe = ImageStore()
    one = probe.features(probe.add(images[0]), processor, placeholder).nbytes
    store = ImageStore(max_feature_bytes=2 * one)  # room for two (the images are the same size)
    ids = [store.add(im) for im in images]
    store.features(ids[0], processor, placeholder)
    store.features(ids[1], processor, placeholder)
    store.features(ids[0], processor, placeholder)  # 0 is now the most recently used
    assert store.feature_computations == 2 and store.feature_bytes == 2 * one
    store.features(ids[2], processor, placeholder)  # evicts 1, the least recently used
    assert store.feature_computations == 3 and store.feature_bytes == 2 * one
    store.features(ids[0], processor, placeholder)
    assert store.feature_computations == 3
    store.features(ids[1], processor, placeholder)
    assert store.feature_computations == 4
    tiny = ImageStore(max_feature_bytes=1)  # the newest is always kept, even over the bound
    tiny.features(tiny.add(images[0]), processor, placeholder)
    assert tiny.feature_bytes == one


def test_retain_drops_other_images_and_their_features(qwen):
    placeholder, processor = qwen
    store = ImageStore()
    keep, drop = store.add(noise_image((64, 64), 5)), store.add(noise_image((32, 64), 6))
    kept = store.features(keep, processor, placeholder)
    store.features(drop, processor, placeholder)
    store.retain([keep])
    assert keep in store and drop not in store and len(store) == 1
    assert store.feature_bytes == kept.nbytes
    assert store.features(keep, processor, placeholder) is kept and store.feature_computations == 2
    store.retain([])
    assert len(store) == 0 and store.feature_bytes == 0


def test_token_aligned_keys_are_those_shaped_like_the_ids_for_one_and_two_images(qwen):
    placeholder, processor = qwen
    keys = token_aligned_keys(processor, placeholder, noise_image((64, 64), 7))
    out = processor(text=[placeholder], images=[noise_image((64, 64), 7)], return_tensors="pt")
    assert keys == {
        k for k, v in out.items() if k not in ("input_ids", "attention_mask") and v.shape == out["input_ids"].shape
    }
    assert "mm_token_type_ids" in keys and "pixel_values" not in keys


class _Tokenizer:
    def __init__(self, pad, eos):
        self.pad_token_id, self.eos_token_id = pad, eos


def test_pad_token_falls_back_to_end_of_text():
    assert pad_token_id(_Tokenizer(7, 3)) == 7
    assert pad_token_id(_Tokenizer(0, 3)) == 0  # id 0 is a real id
    assert pad_token_id(_Tokenizer(None, 3)) == 3


def test_pad_and_concat_keeps_lists_and_a_lone_tensor_and_refuses_mixed_ranks():
    a = {"pixel": torch.ones(2, 3), "names": ["a"]}
    b = {"pixel": torch.ones(1, 5), "names": ["b", "c"]}
    batch = pad_and_concat([a, b])
    assert batch["names"] == ["a", "b", "c"]
    assert batch["pixel"].shape == (3, 5) and batch["pixel"][:2, 3:].abs().sum() == 0 and batch["pixel"][2].sum() == 5
    alone = pad_and_concat([a])
    assert alone["pixel"] is a["pixel"]
    with pytest.raises(ValueError, match=r"pixel: images give tensors of different ranks \[1, 2\]"):
        pad_and_concat([a, {"pixel": torch.ones(3), "names": []}])


def test_features_of_a_processor_that_adds_text_around_the_image():
    """A processor whose expansion adds plain text around the added tokens: that text is kept apart, as text."""

    class Tok:
        added_tokens_decoder = {90: "<img>", 91: "</img>"}

        def decode(self, ids, **kwargs):
            return "".join({1: "\n", 2: " ", 90: "<img>", 91: "</img>", 50: "#"}[i] for i in ids)

    class Proc:
        tokenizer = Tok()

        def __call__(self, text, images, add_special_tokens, return_tensors):
            n = len(images)
            ids = ([1, 90, 50, 50, 91, 2]) * n
            return {
                "input_ids": torch.tensor([ids]),
                "attention_mask": torch.ones(1, len(ids)),
                "kind": torch.tensor([[0, 1, 1, 1, 1, 0] * n]),
                "pixels": torch.zeros(n, 4),
            }

    keys = token_aligned_keys(Proc(), "<image>", object())
    assert keys == {"kind"}
    features = process_image(Proc(), "<image>", object(), keys)
    assert features.token_ids == (90, 50, 50, 91)
    assert features.token_inputs == {"kind": (1, 1, 1, 1)}
    assert features.text_before == "\n" and features.text_after == " "
    assert set(features.tensors) == {"pixels"}


class _BareTokenizerProcessor:
    """A processor that is its own tokenizer (no ``.tokenizer``) and has no added tokens: its whole expansion is the
    image's."""

    added_tokens_decoder: dict = {}

    def __init__(self):
        self.calls = 0

    def decode(self, ids, **kwargs):
        return "#" * len(ids)

    def __call__(self, text, images, add_special_tokens, return_tensors):
        self.calls += 1
        n = len(images)
        return {
            "input_ids": torch.tensor([[50, 51, 52] * n]),
            "kind": torch.tensor([[1, 1, 1] * n]),
            "pixels": torch.zeros(n, 2),
        }


def test_an_expansion_without_added_tokens_is_all_the_image_s_and_the_probe_runs_once_per_processor():
    processor = _BareTokenizerProcessor()
    store = ImageStore()
    ids = [store.add(Image.new("RGB", (2, 2), colour)) for colour in ("red", "blue")]
    features = store.features(ids[0], processor, "<image>")
    assert features.token_ids == (50, 51, 52) and features.token_inputs == {"kind": (1, 1, 1)}
    assert features.text_before == features.text_after == "" and set(features.tensors) == {"pixels"}
    assert processor.calls == 3  # the token-aligned probe (one image, then two), then the image itself
    store.features(ids[1], processor, "<image>")
    assert processor.calls == 4  # the probe's answer is kept for this processor and placeholder


def test_two_processors_sharing_a_store_each_get_their_own_features(qwen):
    """The feature cache is per processor: a second processor with another resolution gets its own grid, as its own
    image processor computes it, not the first one's cached features."""
    placeholder, processor = qwen
    other = copy.deepcopy(processor)
    other.image_processor.size = {"longest_edge": 32 * 32 * 4, "shortest_edge": 32 * 32}
    store = ImageStore()
    image = noise_image((128, 128), 1)
    image_id = store.add(image)
    for p in (processor, other, processor):
        expected = p.image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
        assert torch.equal(store.features(image_id, p, placeholder).tensors["image_grid_thw"], expected)
    assert store.feature_computations == 2
