"""Prompt encoding against the family's own processor: spans, token-aligned inputs, collation, continuation."""

from __future__ import annotations

import subprocess
import sys
import types

import attrs
import pytest
import torch
from PIL import Image

import vlmreg
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.data import ImageStore
from vlmreg.data.prompts import (
    _ASSISTANT_PROBE,
    ImageTokenError,
    PromptEncoder,
    image_placeholder,
    turn_end_ids,
    vision_token_ids,
)
from vlmreg.data.store import VIDEO_ID_PREFIX, pad_and_concat
from vlmreg.loading.load import load
from vlmreg.sdk.descriptor import VisionTokens
from vlmreg.testing.parity import noise_image, processor_inputs


@pytest.fixture(scope="module")
def qwen():
    descriptor = vlmreg.get_family("qwen3_vl")
    return descriptor, descriptor.tiny_processor()


def ask(parts, text="what colour ?"):
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_a_three_token_image_is_not_mistaken_for_a_token_aligned_input(qwen):
    """A 32x96 image expands to 3 tokens while its grid is (1, 3): only a two-image probe tells them apart."""
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    image = noise_image((32, 96), 0)
    prompt = encoder.encode(ask([{"type": "image", "image": encoder.store.add(image)}]))
    reference = processor_inputs(processor, ask([{"type": "image", "image": image}]))
    assert prompt.input_ids == reference["input_ids"][0].tolist() and prompt.image_tokens == [3]
    assert torch.equal(encoder.image_inputs(prompt.image_ids)["image_grid_thw"], reference["image_grid_thw"])
    assert list(encoder.image(prompt.image_ids[0]).token_inputs) == ["mm_token_type_ids"]


def test_each_image_is_processed_once_however_often_it_is_shown(qwen):
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    image_id = encoder.store.add(noise_image((64, 64), 1))
    for _ in range(3):
        encoder.encode(ask([{"type": "image", "image": image_id}, {"type": "image", "image": image_id}]))
    assert encoder.store.feature_computations == 1


def test_tokens_that_disagree_with_the_images_are_an_error_naming_the_sample(qwen):
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    first, second = encoder.store.add(noise_image((64, 64), 2)), encoder.store.add(noise_image((32, 64), 3))
    prompt = encoder.encode(ask([{"type": "image", "image": first}, {"type": "image", "image": second}]))
    encoder.check(prompt.input_ids, prompt.image_ids, prompt.image_spans, "ok")
    with pytest.raises(ImageTokenError, match=r"ep:7: image 1 of 2 should occupy tokens"):
        encoder.check(prompt.input_ids, list(reversed(prompt.image_ids)), prompt.image_spans, "ep:7")
    with pytest.raises(ImageTokenError, match=r"ep:7: 2 image\(s\) but 1 image span"):
        encoder.check(prompt.input_ids, prompt.image_ids, prompt.image_spans[:1], "ep:7")


def test_a_template_that_drops_an_image_is_an_error(qwen):
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    image_id = encoder.store.add(noise_image((64, 64), 4))
    with pytest.raises(ImageTokenError, match=r"x:1: the chat template rendered 0 image (or video )?placeholder"):
        encoder.tokenize("no placeholder here", [image_id], "x:1")


def test_pad_and_concat_pads_later_dimensions_like_a_processor_batch():
    a = {"pixel": torch.ones(1, 3, 4, 6), "size": torch.tensor([[4, 6]])}
    b = {"pixel": torch.full((1, 3, 5, 2), 2.0), "size": torch.tensor([[5, 2]])}
    batch = pad_and_concat([a, b])
    assert batch["pixel"].shape == (2, 3, 5, 6) and torch.equal(batch["size"], torch.tensor([[4, 6], [5, 2]]))
    assert torch.equal(batch["pixel"][0, :, :4, :6], a["pixel"][0]) and batch["pixel"][0, :, 4:].abs().sum() == 0
    assert torch.equal(batch["pixel"][1, :, :5, :2], b["pixel"][0]) and batch["pixel"][1, :, :, 2:].abs().sum() == 0
    with pytest.raises(ValueError, match="different processor outputs"):
        pad_and_concat([a, {"pixel": a["pixel"]}])


def test_a_continued_prompt_keeps_the_sampled_tokens_and_appends_what_the_template_renders(qwen):
    """Even a completion the template would render differently (here: cut short, no turn end) stays token for token."""
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    image = noise_image((64, 64), 5)
    prompt = encoder.encode(ask([{"type": "image", "image": encoder.store.add(image)}]))
    sampled = encoder.tokenizer("re d", add_special_tokens=False)["input_ids"]  # no turn end: cut at max_tokens
    second = noise_image((32, 64), 6)
    nxt = encoder.extend(prompt, sampled, ask([{"type": "image", "image": encoder.store.add(second)}], "and this ?"))
    turn_end = encoder.stop_ids[0]
    assert nxt.input_ids[: len(prompt.input_ids) + len(sampled) + 1] == [*prompt.input_ids, *sampled, turn_end]
    # what follows is the processor's own rendering of the new turn (the tail of the whole conversation's encoding)
    whole = processor_inputs(
        processor,
        [
            *ask([{"type": "image", "image": image}]),
            {"role": "assistant", "content": "x"},
            *ask([{"type": "image", "image": second}], "and this ?"),
        ],
    )["input_ids"][0].tolist()
    tail = nxt.input_ids[len(prompt.input_ids) + len(sampled) + 1 :]
    assert whole[-len(tail) :] == tail and whole[-len(tail) - 1] == turn_end
    encoder.check(nxt.input_ids, nxt.image_ids, nxt.image_spans, "continued")


def test_vlmreg_testing_imports_and_builds_a_tiny_model_without_pytest():
    """The README's `from vlmreg.testing import tiny_model` works in a plain install (pytest blocked)."""
    code = (
        "import sys; sys.modules['pytest'] = None\n"
        "from vlmreg.testing import tiny_model\n"
        "print(type(tiny_model('qwen3_vl')).__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "Qwen3VLForConditionalGeneration"


def test_the_image_placeholder_must_be_a_token(qwen, tmp_path):
    """A family whose placeholder is not in the tokenizer is refused when the model loads, naming the family."""

    descriptor, _ = qwen
    broken = attrs.evolve(descriptor, image_placeholder="<not-a-token>")
    rc = resolve_config(parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}}))
    with pytest.raises(
        vlmreg.VlmregError, match=r"image placeholder '<not-a-token>' \(family qwen3_vl\) is not a token"
    ):
        load(attrs.evolve(rc, family=broken))


def test_images_of_two_sizes_in_one_call_match_the_processor(qwen):
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    images = [Image.new("RGB", (64, 64), "red"), Image.new("RGB", (96, 32), "blue")]
    prompt = encoder.encode(ask([{"type": "image", "image": encoder.store.add(im)} for im in images]))
    reference = processor_inputs(processor, ask([{"type": "image", "image": im} for im in images]))
    assert prompt.input_ids == reference["input_ids"][0].tolist()
    mine = encoder.image_inputs(prompt.image_ids)
    assert all(torch.equal(mine[k], reference[k]) for k in ("pixel_values", "image_grid_thw"))


def test_without_a_descriptor_the_processor_s_image_token_eos_and_default_collation_serve(qwen):
    _, processor = qwen
    encoder = PromptEncoder(processor, ImageStore())
    assert encoder.placeholder == processor.image_token
    assert encoder.stop_ids == (processor.tokenizer.eos_token_id,)
    image = noise_image((64, 64), 8)
    prompt = encoder.encode(ask([{"type": "image", "image": encoder.store.add(image)}]))
    reference = processor_inputs(processor, ask([{"type": "image", "image": image}]))
    assert prompt.input_ids == reference["input_ids"][0].tolist()
    assert torch.equal(encoder.image_inputs(prompt.image_ids)["pixel_values"], reference["pixel_values"])


def test_turn_end_ids_are_the_family_s_tokens_then_the_tokenizer_s_eos(qwen):
    _, processor = qwen
    tokenizer = processor.tokenizer
    family = types.SimpleNamespace(turn_end_tokens=("<|endoftext|>",), name="fam", image_placeholder=None)
    assert turn_end_ids(processor, family) == (tokenizer.convert_tokens_to_ids("<|endoftext|>"), tokenizer.eos_token_id)
    both = types.SimpleNamespace(turn_end_tokens=("<|im_end|>", "<|endoftext|>"))
    assert turn_end_ids(processor, both) == tuple(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    with pytest.raises(vlmreg.VlmregError, match=r"turn_end_tokens entry 'two words' is \d+ tokens for this tokenizer"):
        turn_end_ids(processor, types.SimpleNamespace(turn_end_tokens=("two words",)))
    with pytest.raises(
        vlmreg.VlmregError, match="family fam: the processor has no image_token; set the descriptor's image_placeholder"
    ):
        image_placeholder(types.SimpleNamespace(tokenizer=tokenizer), family)


def test_a_span_that_overlaps_the_previous_image_is_an_error_even_with_the_right_tokens(qwen):
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    image_id = encoder.store.add(noise_image((64, 64), 9))
    prompt = encoder.encode(ask([{"type": "image", "image": image_id}]))
    encoder.check(prompt.input_ids, prompt.image_ids, prompt.image_spans, "once")
    twice = [image_id, image_id]
    with pytest.raises(ImageTokenError, match=r"where: image 2 of 2 should occupy tokens"):
        encoder.check(prompt.input_ids, twice, [prompt.image_spans[0]] * 2, "where")  # one span claimed by two images
    with pytest.raises(ImageTokenError, match=r"where: 2 image\(s\) but 1 image span\(s\)"):
        encoder.check(prompt.input_ids, twice, prompt.image_spans, "where")


def test_a_continued_prompt_s_text_is_the_template_s_rendering_of_the_whole_conversation(qwen):
    """Its text is what the template renders for the whole conversation, even when a message quotes the probe text
    the encoder renders to find where an assistant turn ends."""

    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    first = [{"role": "user", "content": "what colour ?"}]
    prompt = encoder.encode(first)
    answer = "red"
    sampled = [*encoder.tokenizer(answer, add_special_tokens=False)["input_ids"], encoder.stop_ids[0]]
    then = [{"role": "user", "content": f"you said {_ASSISTANT_PROBE} before"}]
    nxt = encoder.extend(prompt, sampled, then)
    whole = processor.apply_chat_template(
        [*first, {"role": "assistant", "content": answer}, *then], add_generation_prompt=True, tokenize=False
    )
    assert nxt.text == whole
    assert nxt.input_ids == processor(text=[whole], return_tensors="pt")["input_ids"][0].tolist()


def test_a_template_that_renders_none_of_the_turn_end_tokens_is_an_error_naming_the_fix(qwen):
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    encoder.stop_ids = (processor.tokenizer.convert_tokens_to_ids("<|endoftext|>"),)
    with pytest.raises(
        vlmreg.VlmregError,
        match=r"ends an assistant turn with none of the turn-end tokens \['<\|endoftext\|>'\]; set the family's "
        r"turn_end_tokens",
    ):
        encoder.continuation_text([{"role": "user", "content": "more"}])


class _BosProcessor:
    """A processor whose tokenizer puts a BOS token before the text itself (its chat template does not write one), and
    expands each image placeholder to added tokens: image spans must move past the BOS with the ids."""

    image_token = "<image>"
    EXPANSION = [900, 901, 901, 902]

    def __init__(self):
        self.tokenizer = self

    # the tokenizer's side
    bos_token, eos_token_id, pad_token_id, unk_token_id = "<s>", 2, 0, 3
    added_tokens_decoder = {900: "<img>", 901: "<pad>", 902: "</img>"}

    def __call__(self, text, images=None, add_special_tokens=True, return_tensors=None):
        if isinstance(text, str):  # the tokenizer itself: one id per character
            return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}
        ids = [] if add_special_tokens is False else [1]
        pieces = text[0].split(self.image_token)
        ids += [ord(c) for c in pieces[0]]
        for piece in pieces[1:]:
            ids += self.EXPANSION + [ord(c) for c in piece]
        out = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        if images:
            out["pixel_values"] = torch.stack([torch.tensor(im.getpixel((0, 0)), dtype=torch.float32) for im in images])
        return out

    def decode(self, ids, **kwargs):
        return "".join(self.added_tokens_decoder.get(i, chr(i)) for i in ids)

    def convert_ids_to_tokens(self, i):
        return "</s>" if i == 2 else chr(i)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def apply_chat_template(self, chat, add_generation_prompt, tokenize, **kwargs):
        def content(c):
            return (
                c if isinstance(c, str) else "".join(self.image_token if p["type"] == "image" else p["text"] for p in c)
            )

        return "".join(f"[{m['role']}]{content(m['content'])}" for m in chat) + (
            "[assistant]" if add_generation_prompt else ""
        )


def test_image_spans_follow_the_special_tokens_the_processor_adds_before_the_text():
    processor = _BosProcessor()
    encoder = PromptEncoder(processor, ImageStore())
    image = Image.new("RGB", (4, 4), "red")
    prompt = encoder.encode(ask([{"type": "image", "image": encoder.store.add(image)}], "hi"))
    reference = processor(text=[prompt.text], images=[image])["input_ids"][0].tolist()
    assert prompt.input_ids == reference and reference[0] == 1
    ((start, end),) = prompt.image_spans
    assert reference[start:end] == _BosProcessor.EXPANSION
    encoder.check(prompt.input_ids, prompt.image_ids, prompt.image_spans, "bos")


def test_token_aligned_inputs_of_a_batch_equal_the_processor_s(qwen):
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    images = [noise_image((64, 64), 10), noise_image((32, 64), 11)]
    prompt = encoder.encode(ask([{"type": "image", "image": encoder.store.add(im)} for im in images]))
    reference = processor_inputs(processor, ask([{"type": "image", "image": im} for im in images]))
    width = len(prompt.input_ids) + 3  # a padded row: zeros after the prompt
    rows = [[(0, i, span) for i, span in zip(prompt.image_ids, prompt.image_spans, strict=True)], []]
    out = encoder.token_inputs(width, rows)
    assert set(out) == set(encoder.token_input_keys(prompt.image_ids)) == {"mm_token_type_ids"}
    assert out["mm_token_type_ids"].dtype == reference["mm_token_type_ids"].dtype == torch.long
    assert out["mm_token_type_ids"][0, : len(prompt.input_ids)].tolist() == reference["mm_token_type_ids"][0].tolist()
    assert (
        out["mm_token_type_ids"][0, len(prompt.input_ids) :].tolist() == [0, 0, 0]
        and not out["mm_token_type_ids"][1].any()
    )


def test_vision_token_ids_are_the_tokenizer_s_ids_of_the_family_s_vision_tokens(qwen):
    descriptor, processor = qwen
    names = {processor.image_token, *(t for t in attrs.astuple(descriptor.vision_tokens) if t)}
    expected = tuple(sorted(processor.tokenizer.convert_tokens_to_ids(sorted(names))))
    assert vision_token_ids(processor, descriptor) == expected
    assert processor.tokenizer.convert_tokens_to_ids("<|vision_start|>") in expected


def test_a_video_for_a_family_without_video_is_an_error_saying_so():
    descriptor = vlmreg.get_family("gemma3")
    assert descriptor.max_videos_per_message == 0
    encoder = PromptEncoder(descriptor.tiny_processor(), ImageStore(), descriptor)
    with pytest.raises(ImageTokenError) as caught:
        encoder.image(VIDEO_ID_PREFIX + "0" * 24)
    assert str(caught.value) == (
        "family gemma3 takes no video input (its descriptor's max_videos_per_message is 0); give the frames as images, "
        "or use a family that declares video"
    )


def test_vision_token_ids_join_the_placeholder_the_processor_s_image_token_and_the_family_s_tokens(qwen):
    """Each source counts on its own: without a descriptor, the processor's image token alone; a family whose
    placeholder and vision tokens name other tokens (here the start marker, and a token the tokenizer lacks, which it
    maps to no id of its own) still gets the processor's image token; ids read off the tokenizer."""
    descriptor, processor = qwen
    tokenizer = processor.tokenizer
    assert vision_token_ids(processor, None) == (tokenizer.convert_tokens_to_ids(processor.image_token),)
    other = attrs.evolve(
        descriptor,
        image_placeholder="<|vision_start|>",
        vision_tokens=VisionTokens(image="<|vision_end|>", video="<no such token>"),
    )
    assert tokenizer.convert_tokens_to_ids("<no such token>") in (None, tokenizer.unk_token_id)
    names = ["<|vision_start|>", "<|vision_end|>", processor.image_token]
    assert vision_token_ids(processor, other) == tuple(sorted(tokenizer.convert_tokens_to_ids(names)))


def test_token_input_keys_are_the_processor_s_once_each(qwen):
    """The inputs aligned with ``input_ids`` that the processor returns for text alone, and for images; each named
    once however many images add it."""
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    out = processor(text=["a"], return_tensors="pt")
    aligned = [
        k for k, v in out.items() if k not in ("input_ids", "attention_mask") and v.shape == out["input_ids"].shape
    ]
    assert encoder.token_input_keys() == aligned == ["mm_token_type_ids"]
    images = [encoder.store.add(noise_image((64, 64), k)) for k in range(3)]
    for count in (1, 2, 3):
        assert encoder.token_input_keys(images[:count]) == aligned
