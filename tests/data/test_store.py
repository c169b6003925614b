"""`ImageStore`: ids by content, features equal to the processor's own output for the image, a cache bounded in bytes.

References: PIL's own pixels (equal content, equal id), the family's processor called directly on the image with
its placeholder, and byte counts computed from the tensors' sizes.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.video_utils import VideoMetadata

import vlmreg
from vlmreg.data import ImageStore
from vlmreg.data.prompts import image_placeholder, video_placeholder
from vlmreg.data.store import (
    ImageTokenError,
    image_id_of,
    pad_and_concat,
    pad_token_id,
    process_image,
    token_aligned_keys,
    video_inputs,
)
from vlmreg.data.video import DecodedVideo
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
    rgb = Image.new("RGB", (3, 3), "green")
    assert store.get(store.add(rgb)) is rgb  # an RGB image is held as given, not copied


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
    tiny.features(tiny.add(images[1]), processor, placeholder)  # evicts the first: only the newest is over the bound
    assert tiny.feature_bytes == one and tiny.feature_computations == 2
    tiny.features(tiny.add(images[0]), processor, placeholder)
    assert tiny.feature_computations == 3


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
    listed_first = pad_and_concat(
        [{"names": ["a"], "pixel": torch.ones(1, 2)}, {"names": ["b"], "pixel": torch.ones(1, 2)}]
    )
    assert listed_first["names"] == ["a", "b"] and listed_first["pixel"].shape == (2, 2)  # a list before a tensor
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
    """A processor that is its own tokenizer (no ``.tokenizer``) without added tokens (no ``added_tokens_decoder`` at
    all): its whole expansion is the image's. It also returns an output that is a list, not a tensor."""

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
            "image_sizes": [[2, 2]] * n,
        }


def test_an_expansion_without_added_tokens_is_all_the_image_s_and_the_probe_runs_once_per_processor():
    processor = _BareTokenizerProcessor()
    store = ImageStore()
    ids = [store.add(Image.new("RGB", (2, 2), colour)) for colour in ("red", "blue")]
    features = store.features(ids[0], processor, "<image>")
    assert features.token_ids == (50, 51, 52) and features.token_inputs == {"kind": (1, 1, 1)}
    assert features.text_before == features.text_after == "" and set(features.tensors) == {"pixels", "image_sizes"}
    assert features.tensors["image_sizes"] == [[2, 2]]
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


class _TextAroundProcessor:
    """A processor over a real tokenizer whose image expansion adds plain text around the added tokens (as Gemma 3's
    blank lines do); with ``own_tokenizer`` it is its own tokenizer (no ``.tokenizer``), as a bare tokenizer is."""

    BEFORE, IMAGE, AFTER = "Look , then:", "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>", " !"

    def __init__(self, tokenizer, own_tokenizer=False):
        self._tokenizer = tokenizer
        if own_tokenizer:
            self.added_tokens_decoder = tokenizer.added_tokens_decoder
            self.decode = tokenizer.decode
        else:
            self.tokenizer = tokenizer

    def __call__(self, text, images, add_special_tokens, return_tensors):
        n = len(images)
        ids = self._tokenizer(self.BEFORE + self.IMAGE + self.AFTER, add_special_tokens=False)["input_ids"] * n
        pad = self._tokenizer.convert_tokens_to_ids("<|image_pad|>")
        return {
            "input_ids": torch.tensor([ids]),
            "mm_token_type_ids": torch.tensor([[int(i == pad) for i in ids]]),
            "pixel_values": torch.zeros(2 * n, 4),
        }


@pytest.mark.parametrize("own_tokenizer", [False, True])
def test_plain_text_around_an_expansion_comes_back_as_the_processor_wrote_it(qwen, own_tokenizer):
    """The text before and after the added tokens is the processor's own text, character for character, with a
    tokenizer whose decode cleans up spaces by default, even for its BPE (as transformers' LUKE tokenizers do):
    `` ,`` and `` !`` stay as written, so they tokenize back to the processor's ids."""
    tokenizer = copy.deepcopy(qwen[1].tokenizer)
    tokenizer.clean_up_tokenization_spaces = True
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert tokenizer.decode(tokenizer(" !")["input_ids"]) == "!"  # the default this test needs
    processor = _TextAroundProcessor(tokenizer, own_tokenizer)
    store = ImageStore()
    features = store.features(store.add(Image.new("RGB", (2, 2))), processor, "<image>")
    assert features.text_before == _TextAroundProcessor.BEFORE and features.text_after == _TextAroundProcessor.AFTER
    image_ids = tokenizer(_TextAroundProcessor.IMAGE, add_special_tokens=False)["input_ids"]
    assert list(features.token_ids) == image_ids
    assert features.token_inputs == {"mm_token_type_ids": (0, 1, 1, 0)} and set(features.tensors) == {"pixel_values"}


@pytest.mark.parametrize("marked", ["before", "after"])
def test_a_token_input_marking_plain_text_on_either_side_of_the_expansion_is_refused(marked):
    """``kind`` marks the plain ``\\n`` before the added tokens, or the `` `` after them: vlmreg cannot place such an
    input in a prompt, whichever side it is on."""

    class Tok:
        added_tokens_decoder = {90: "<img>", 91: "</img>"}

        def decode(self, ids, **kwargs):
            return "".join({1: "\n", 2: " ", 90: "<img>", 91: "</img>", 50: "#"}[i] for i in ids)

    class Proc:
        tokenizer = Tok()

        def __call__(self, text, images, add_special_tokens, return_tensors):
            kind = [1, 1, 1, 1, 1, 0] if marked == "before" else [0, 1, 1, 1, 1, 1]
            return {"input_ids": torch.tensor([[1, 90, 50, 50, 91, 2]]), "kind": torch.tensor([kind])}

    message = (
        "the processor's 'kind' marks plain-text tokens around an image's expansion; vlmreg cannot place it in a "
        "prompt (give the family an image_placeholder whose expansion starts and ends at added tokens)"
    )
    with pytest.raises(ImageTokenError, match=f"^{re.escape(message)}$"):
        process_image(Proc(), "<image>", object(), frozenset({"kind"}))


def _clip():
    """Four frames 48 wide and 32 high, taken at frames 0, 6, 13 and 19 of a 20-frame clip at 5 fps."""
    frames = tuple(noise_image((48, 32), 40 + k) for k in range(4))
    return DecodedVideo(frames, 5.0, 20, (0, 6, 13, 19))


def test_a_video_s_processor_arguments_are_its_frames_and_timing():
    """`video_inputs` against the frames' own pixels and the clip's timing: a (T, H, W, 3) uint8 array and the metadata
    a processor (or vLLM) reads, built here from the clip's facts."""
    clip = _clip()
    store = ImageStore()
    stored = store.video(store.add_video(clip))
    inputs = video_inputs(stored, [store.get(f) for f in stored.frame_ids])
    assert set(inputs) == {"videos", "video_metadata", "do_sample_frames"} and inputs["do_sample_frames"] is False
    (array,) = inputs["videos"]
    assert array.dtype == np.uint8 and array.shape == (4, 32, 48, 3)
    assert np.array_equal(array, np.stack([np.asarray(frame) for frame in clip.frames]))
    expected = VideoMetadata(
        total_num_frames=20, fps=5.0, width=48, height=32, duration=4.0, frames_indices=[0, 6, 13, 19]
    )
    assert inputs["video_metadata"] == [expected]


def test_a_video_s_features_are_the_processors_output_for_the_video_alone(qwen):
    """The store's features of a video against the family's processor called directly on the same frames and timing,
    with the video placeholder: Qwen3-VL writes each frame pair's timestamp as plain text (``<0.6 seconds>``) before
    its added tokens, so the ids read back from the text before, the expansion and the text after must be the
    processor's, and the timestamps follow the clip's frame rate and frame indices."""
    processor = qwen[1]
    placeholder = video_placeholder(processor, vlmreg.get_family("qwen3_vl"))
    clip = _clip()
    store = ImageStore()
    video_id = store.add_video(clip)
    assert store.has_video(video_id) and not store.has_video(store.add(clip.frames[0]))
    with pytest.raises(KeyError, match="video 'video:nope' is not in the image store"):
        store.video("video:nope")
    features = store.features(video_id, processor, placeholder)
    metadata = VideoMetadata(
        total_num_frames=20, fps=5.0, width=48, height=32, duration=4.0, frames_indices=[0, 6, 13, 19]
    )
    out = processor(
        text=[placeholder],
        videos=[np.stack([np.asarray(frame) for frame in clip.frames])],
        video_metadata=[metadata],
        do_sample_frames=False,
        add_special_tokens=False,
        return_tensors="pt",
    )
    tokenizer = processor.tokenizer
    assert features.text_before == "<0.6 seconds>"  # frames 0 and 6 at 5 fps: their mean time, as Qwen3-VL writes it
    before = tokenizer(features.text_before, add_special_tokens=False)["input_ids"]
    after = tokenizer(features.text_after, add_special_tokens=False)["input_ids"]
    assert before + list(features.token_ids) + after == out["input_ids"][0].tolist()
    first, last = len(before), len(before) + len(features.token_ids)
    assert set(features.token_inputs) == {"mm_token_type_ids"}
    assert list(features.token_inputs["mm_token_type_ids"]) == out["mm_token_type_ids"][0, first:last].tolist()
    assert set(features.tensors) == {"pixel_values_videos", "video_grid_thw"}
    for key, value in features.tensors.items():
        assert torch.equal(value, out[key]), key
    assert store.features(video_id, processor, placeholder) is features and store.feature_computations == 1
