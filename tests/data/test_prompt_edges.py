"""Prompt encoding at its edges, each against the family's processor: a template that writes the BOS itself, turn ends
other than the tokenizer's eos, template arguments, the family's fields over the processor's, and the errors for
what vlmreg cannot encode (each message whole, with where it happened)."""

from __future__ import annotations

import copy
import types

import attrs
import pytest
import torch

import vlmreg
from vlmreg.data import ImageStore
from vlmreg.data import prompts as prompts_module
from vlmreg.data.prompts import (
    ImageTokenError,
    ProcessorContractError,
    PromptEncoder,
    image_placeholder,
    turn_end_ids,
    video_placeholder,
    vision_token_ids,
)
from vlmreg.data.store import VIDEO_ID_PREFIX
from vlmreg.sdk.descriptor import VisionTokens
from vlmreg.testing.parity import noise_image, processor_inputs

VIDEO_ID = VIDEO_ID_PREFIX + "0" * 24  # tokenize checks placeholders before it reads any image


@pytest.fixture(scope="module")
def qwen():
    descriptor = vlmreg.get_family("qwen3_vl")
    return descriptor, descriptor.tiny_processor()


@pytest.fixture(scope="module")
def gemma():
    descriptor = vlmreg.get_family("gemma3")
    return descriptor, descriptor.tiny_processor()


@pytest.fixture(scope="module")
def paligemma():
    descriptor = vlmreg.get_family("paligemma")
    return descriptor, descriptor.tiny_processor()


def ask(parts, text="what colour ?"):
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_a_template_that_writes_the_bos_and_a_turn_end_other_than_eos_give_the_processor_s_encoding(gemma):
    """Gemma 3's template writes ``<bos>`` (the tokenizer must not add another) and ends turns with ``<end_of_turn>``,
    not the tokenizer's eos; its template refuses roles out of order, so the probe a continuation renders must be a
    real user turn. Prompt and next turn are the processor's own encodings of the conversation."""
    descriptor, processor = gemma
    tokenizer = processor.tokenizer
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    image = noise_image((64, 64), 0)
    prompt = encoder.encode(ask([{"type": "image", "image": encoder.store.add(image)}]))
    own = processor_inputs(processor, ask([{"type": "image", "image": image}]))["input_ids"][0].tolist()
    assert prompt.input_ids == own and own.count(tokenizer.bos_token_id) == 1
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn != tokenizer.eos_token_id and encoder.stop_ids[0] == end_of_turn
    answer = tokenizer("red", add_special_tokens=False)["input_ids"]
    for sampled in (answer, [*answer, end_of_turn]):  # cut short (the turn end is added), and ended
        nxt = encoder.extend(prompt, sampled, [{"role": "user", "content": "and now ?"}])
        whole = [*ask([{"type": "image", "image": image}]), {"role": "assistant", "content": "red"}]
        whole.append({"role": "user", "content": "and now ?"})
        assert nxt.input_ids == processor_inputs(processor, whole)["input_ids"][0].tolist()


def test_template_arguments_and_the_generation_prompt_reach_the_prompt_and_the_next_turn(qwen):
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    first = [{"role": "user", "content": "what colour ?"}]

    def own(messages, generation=True):
        text = processor.apply_chat_template(
            messages, add_generation_prompt=generation, tokenize=False, enable_thinking=False
        )
        return processor(text=[text], return_tensors="pt")["input_ids"][0].tolist()

    prompt = encoder.encode(first, template_kwargs={"enable_thinking": False})
    assert prompt.input_ids == own(first) and "<think>\n\n</think>" in prompt.text  # the argument changed the text
    closed = encoder.encode(first, add_generation_prompt=False, template_kwargs={"enable_thinking": False})
    assert closed.input_ids == own(first, generation=False)
    sampled = [*encoder.tokenizer("red", add_special_tokens=False)["input_ids"], encoder.stop_ids[0]]
    then = [{"role": "user", "content": "sure ?"}]
    nxt = encoder.extend(prompt, sampled, then, template_kwargs={"enable_thinking": False})
    tail = nxt.input_ids[len(prompt.input_ids) + len(sampled) :]
    whole = own([*first, {"role": "assistant", "content": "red"}, *then])
    assert whole[-len(tail) :] == tail and nxt.text.endswith("<think>\n\n</think>\n\n")


def test_text_that_holds_the_image_placeholder_is_refused_naming_the_prompt(qwen, gemma):
    """A user who types the placeholder adds an image the data does not have: the whole message, with the default
    ``where`` of both encode and extend, and the placeholders the family has (one without video, two with)."""
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    image_id = encoder.store.add(noise_image((64, 64), 1))
    two = (
        "prompt: the chat template rendered 2 image or video placeholder(s) '<|image_pad|>' / '<|video_pad|>' for 1 "
        "image(s) and video(s); an image would be dropped or duplicated"
    )
    with pytest.raises(ImageTokenError) as caught:
        encoder.encode(ask([{"type": "image", "image": image_id}], "is <|image_pad|> red ?"))
    assert str(caught.value) == two
    prompt = encoder.encode([{"role": "user", "content": "hi"}])
    with pytest.raises(ImageTokenError) as caught:
        encoder.extend(prompt, [encoder.stop_ids[0]], ask([{"type": "image", "image": image_id}], "<|image_pad|> ?"))
    assert str(caught.value) == two
    descriptor, processor = gemma
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    image_id = encoder.store.add(noise_image((64, 64), 2))
    with pytest.raises(ImageTokenError) as caught:
        encoder.encode(ask([{"type": "image", "image": image_id}], "is <start_of_image> red ?"))
    assert str(caught.value) == (
        "prompt: the chat template rendered 2 image placeholder(s) '<start_of_image>' for 1 image(s); an image would "
        "be dropped or duplicated"
    )


@pytest.mark.parametrize(
    ("text", "ids", "message"),
    [
        (
            "a<|video_pad|>b<|image_pad|>",
            ("image", VIDEO_ID),
            "placeholder 1 is '<|video_pad|>', but it stands for an image",
        ),
        (
            "a<|image_pad|>b<|video_pad|>",
            (VIDEO_ID, "image"),
            "placeholder 1 is '<|image_pad|>', but it stands for a video",
        ),
    ],
)
def test_placeholders_in_another_order_than_the_images_and_videos_are_refused(qwen, text, ids, message):
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    image_id = encoder.store.add(noise_image((64, 64), 3))
    with pytest.raises(ImageTokenError) as caught:
        encoder.tokenize(text, [image_id if i == "image" else i for i in ids], "d.jsonl:2")
    assert str(caught.value) == f"d.jsonl:2: {message}; the template reordered images and videos"


def test_a_video_without_a_video_placeholder_is_refused_with_where_and_who(gemma):
    descriptor, processor = gemma
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    with pytest.raises(ImageTokenError) as caught:
        encoder.tokenize("<start_of_image>", [VIDEO_ID], "r:4")
    assert str(caught.value) == (
        "r:4: family gemma3 takes no video input (its descriptor's max_videos_per_message is 0); give the frames as "
        "images, or use a family that declares video"
    )
    assert getattr(processor, "video_token", None) is None  # without a family, nothing names a video placeholder
    with pytest.raises(ImageTokenError) as caught:
        PromptEncoder(processor, ImageStore()).image(VIDEO_ID)
    assert str(caught.value) == (
        "the processor (Gemma3Processor) has no video token, and no family's descriptor names a video placeholder; "
        "give the frames as images, or the family's descriptor"
    )


def test_the_family_s_fields_come_before_the_processor_s(qwen):
    """Placeholders, turn ends and collation: the descriptor's when it names them, else the processor's; a family
    that declares no video takes none, whatever its processor has."""
    descriptor, processor = qwen
    assert video_placeholder(processor, None) == processor.video_token == "<|video_pad|>"
    assert video_placeholder(processor, descriptor) == "<|video_pad|>"
    assert (
        video_placeholder(processor, attrs.evolve(descriptor, video_placeholder="<|vision_end|>")) == "<|vision_end|>"
    )
    silent = attrs.evolve(descriptor, max_videos_per_message=0)
    assert video_placeholder(processor, silent) is None
    with pytest.raises(ImageTokenError, match="family qwen3_vl takes no video input"):
        PromptEncoder(processor, ImageStore(), silent).image(VIDEO_ID)
    other = attrs.evolve(descriptor, image_placeholder="<|vision_start|>", turn_end_tokens=("<|endoftext|>",))
    encoder = PromptEncoder(processor, ImageStore(), other)
    tokenizer = processor.tokenizer
    assert encoder.placeholder == "<|vision_start|>" and processor.image_token == "<|image_pad|>"
    assert encoder.stop_ids == (tokenizer.convert_tokens_to_ids("<|endoftext|>"), tokenizer.eos_token_id)

    given = []

    def by_image(images):  # a family that keeps each image's tensors apart
        given.extend(images)
        return {"pixel_values": [i["pixel_values"] for i in images]}

    encoder = PromptEncoder(processor, ImageStore(), attrs.evolve(descriptor, collate_images=by_image))
    pictures = [noise_image((64, 64), 4), noise_image((32, 64), 5)]
    out = encoder.image_inputs([encoder.store.add(p) for p in pictures])
    own = [processor(text=[processor.image_token], images=[p], return_tensors="pt") for p in pictures]
    assert len(given) == 2 and all(
        torch.equal(a, b["pixel_values"]) for a, b in zip(out["pixel_values"], own, strict=True)
    )


def test_token_ids_are_read_off_a_bare_tokenizer(qwen, gemma):
    """A processor that is its tokenizer (no ``tokenizer`` or ``image_token`` attribute); an unknown vision token maps
    to the tokenizer's unknown id, which is not a vision token; no turn end at all is refused."""
    descriptor, processor = qwen
    tokenizer = processor.tokenizer
    assert not hasattr(tokenizer, "tokenizer") and not hasattr(tokenizer, "image_token")
    assert turn_end_ids(tokenizer) == (tokenizer.eos_token_id,)
    with pytest.raises(vlmreg.VlmregError) as caught:
        image_placeholder(tokenizer)
    assert str(caught.value) == (
        f"the processor ({type(tokenizer).__name__}) has no image_token; give the family's descriptor, with its "
        "image_placeholder"
    )
    family = attrs.evolve(descriptor, image_placeholder="<|image_pad|>")
    names = ["<|image_pad|>", *(t for t in attrs.astuple(descriptor.vision_tokens) if t)]
    assert vision_token_ids(tokenizer, family) == tuple(sorted(set(tokenizer.convert_tokens_to_ids(names))))
    descriptor, processor = gemma
    tokenizer = processor.tokenizer
    assert tokenizer.convert_tokens_to_ids("<no such token>") == tokenizer.unk_token_id is not None
    family = attrs.evolve(descriptor, vision_tokens=VisionTokens(image="<end_of_image>", video="<no such token>"))
    names = [processor.image_token, "<end_of_image>"]
    assert vision_token_ids(processor, family) == tuple(sorted(set(tokenizer.convert_tokens_to_ids(names))))
    with pytest.raises(vlmreg.VlmregError) as caught:
        turn_end_ids(types.SimpleNamespace(eos_token_id=None))
    assert str(caught.value) == "no turn-end token: the family names none and the tokenizer has no eos token"


def test_an_image_span_may_end_the_ids(qwen):
    """A sample cut right after an image still holds the image whole; one token less does not."""
    descriptor, processor = qwen
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    image = noise_image((64, 64), 6)
    prompt = encoder.encode(ask([{"type": "image", "image": encoder.store.add(image)}]))
    assert (
        prompt.input_ids
        == processor_inputs(processor, ask([{"type": "image", "image": image}]))["input_ids"][0].tolist()
    )
    ((_, end),) = prompt.image_spans
    encoder.check(prompt.input_ids[:end], prompt.image_ids, prompt.image_spans, "cut")
    with pytest.raises(ImageTokenError, match="cut: image 1 of 1 should occupy tokens"):
        encoder.check(prompt.input_ids[: end - 1], prompt.image_ids, prompt.image_spans, "cut")


ONLY_ANSWERS = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NO_ANSWERS = (
    "{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_continuing_with_a_template_that_renders_answers_first_or_never(qwen):
    """A template that renders nothing before an answer (here: answers only) continues as it renders; one that never
    renders an answer cannot be continued."""
    descriptor, processor = qwen
    answers = copy.copy(processor)
    answers.chat_template = ONLY_ANSWERS
    encoder = PromptEncoder(answers, ImageStore(), descriptor)
    first = [{"role": "user", "content": "what colour ?"}]
    prompt = encoder.encode(first)
    sampled = [*encoder.tokenizer("red", add_special_tokens=False)["input_ids"], encoder.stop_ids[0]]
    nxt = encoder.extend(prompt, sampled, [{"role": "user", "content": "sure ?"}])
    whole = answers.apply_chat_template(
        [*first, {"role": "assistant", "content": "red"}, {"role": "user", "content": "sure ?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    tail = nxt.input_ids[len(prompt.input_ids) + len(sampled) :]  # what the template renders after the answer
    own = processor(text=[whole], return_tensors="pt")["input_ids"][0].tolist()
    assert tail and own[-len(tail) - len(sampled) :] == [*sampled, *tail]
    silent = copy.copy(processor)
    silent.chat_template = NO_ANSWERS
    with pytest.raises(vlmreg.VlmregError) as caught:
        PromptEncoder(silent, ImageStore(), descriptor).continuation_text(first)
    assert str(caught.value) == (
        "the chat template does not render an assistant message's content; multi-turn prompts cannot be continued"
    )


class _Refusing:
    """A processor whose own error for text alone has no message."""

    def __init__(self, inner):
        self.tokenizer, self.image_token = inner.tokenizer, inner.image_token

    def __call__(self, **kwargs):
        raise ValueError()


def test_a_refusal_without_a_message_is_named_by_its_type(qwen):
    _, processor = qwen
    with pytest.raises(ProcessorContractError) as caught:
        PromptEncoder(_Refusing(processor), ImageStore()).token_input_keys()
    assert str(caught.value).startswith("the processor (_Refusing) refuses text without images (ValueError: ). ")


def prefix_lm(descriptor):
    return attrs.evolve(descriptor, prefix_lm="token_type_ids", packing=False)


def test_a_one_token_image_of_a_prefix_lm_processor_is_its_own_span(paligemma):
    """PaliGemma's processor writing one token per image: the prompt is still its own encoding, each image one token."""
    descriptor, processor = paligemma
    processor = copy.copy(processor)
    processor.image_seq_length = 1
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    pictures = [noise_image((32, 32), 7), noise_image((32, 32), 8)]
    prompt = encoder.encode(ask([{"type": "image", "image": encoder.store.add(p)} for p in pictures]))
    own = processor_inputs(processor, ask([{"type": "image", "image": p} for p in pictures]))["input_ids"][0].tolist()
    assert prompt.input_ids == own and prompt.image_spans == [(0, 1), (1, 2)]
    assert own[:3] == [processor.image_token_id] * 2 + [processor.tokenizer.bos_token_id]


def two_copies(processor, placeholder):
    """The processor's own encodings of one image and of two copies of it."""
    image = noise_image((32, 32), 9)
    encode = lambda n: processor(  # noqa: E731
        text=[placeholder * n], images=[[image] * n], add_special_tokens=False, return_tensors="pt"
    )["input_ids"][0].tolist()
    return image, encode(1), encode(2)


def test_a_processor_whose_second_image_is_not_one_more_expansion_in_front_is_refused(paligemma, gemma):
    """No token at all for an image (PaliGemma writing none), and Gemma 3's processor declared prefix-LM: two
    images' encoding is not one image's with an expansion in front (its blank lines between images merge), so vlmreg
    cannot tell which tokens an image owns."""
    descriptor, processor = paligemma
    blind = copy.copy(processor)
    blind.image_seq_length = 0
    for family, proc, placeholder in (
        (descriptor, blind, "<image>"),
        (prefix_lm(gemma[0]), gemma[1], "<start_of_image>"),
    ):
        image, one, two = two_copies(proc, placeholder)
        n = len(two) - len(one)
        assert n <= 0 or two[n:] != one  # the processor's own encodings break the requirement
        encoder = PromptEncoder(proc, ImageStore(), family)
        with pytest.raises(ProcessorContractError) as caught:
            encoder.encode(ask([{"type": "image", "image": encoder.store.add(image)}]))
        assert str(caught.value) == (
            f"family {family.name} (prefix_lm): its processor's encoding of two copies of an image ({len(two)} tokens) "
            f"is not one image's ({len(one)} tokens) with one expansion more in front, so vlmreg cannot tell which "
            "tokens an image owns"
        )


def test_the_prefix_lm_expansions_kept_are_bounded(paligemma, monkeypatch):
    descriptor, processor = paligemma
    monkeypatch.setattr(prompts_module, "_EXPANSIONS_KEPT", 2)
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    for k in range(4):
        image = noise_image((32, 32), 10 + k)
        prompt = encoder.encode(ask([{"type": "image", "image": encoder.store.add(image)}]))
        own = processor_inputs(processor, ask([{"type": "image", "image": image}]))["input_ids"][0].tolist()
        assert prompt.input_ids == own and len(encoder._expansions) <= 2


def test_an_image_written_otherwise_in_the_prompt_than_alone_is_refused_naming_it(paligemma):
    """Each image's expansion is what the processor writes for it alone; a processor that then writes it otherwise in
    a prompt (here: PaliGemma's, its image length changed after the expansions were taken) leaves the second image's
    tokens nowhere to be found."""
    descriptor, processor = paligemma
    processor = copy.copy(processor)
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    ids = [encoder.store.add(noise_image((32, 32), 20 + k)) for k in range(2)]
    assert [len(encoder.image(i).token_ids) for i in ids] == [16, 16]
    processor.image_seq_length = 8
    with pytest.raises(ImageTokenError) as caught:
        encoder.encode(ask([{"type": "image", "image": i} for i in ids]), where="d.jsonl:5")
    assert str(caught.value) == (
        "d.jsonl:5: image 2 of 2: its 16 expansion tokens are not in the processor's encoding of the prompt after the "
        "images before it"
    )


def test_prefix_lm_refusals_say_where_who_and_why(paligemma):
    descriptor, processor = paligemma
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    text, _ = encoder.render(ask([]))
    with pytest.raises(Exception) as own:  # the processor's own refusal of a prompt without an image
        processor(text=[text], images=None, return_tensors="pt")
    first = str(own.value).strip().splitlines()[0]
    with pytest.raises(ProcessorContractError) as caught:
        encoder.encode(ask([]), where="d.jsonl:3")
    assert str(caught.value) == (
        f"d.jsonl:3: family paligemma (prefix_lm): its processor (PaliGemmaProcessor) refused the prompt with 0 "
        f"image(s) ({type(own.value).__name__}: {first}); a prefix-LM processor writes each prompt with its images, "
        "and one that needs an image needs one in every prompt"
    )
    prompt = encoder.encode(ask([{"type": "image", "image": encoder.store.add(noise_image((32, 32), 30))}]))
    with pytest.raises(vlmreg.VlmregError) as caught:
        encoder.extend(prompt, [encoder.stop_ids[0]], ask([]))
    assert str(caught.value) == (
        "prompt: family paligemma is a prefix-LM family (descriptor field prefix_lm): its processor writes a "
        "conversation as one prompt prefix, with every image first and the text after, so a prompt cannot go on after "
        "a sampled turn, and a sampled turn would be attended bidirectionally as part of the next prompt; its episodes "
        "take one turn (an environment or task that answers with more messages cannot run on it)"
    )


@pytest.mark.parametrize("template_bos", [False, True])
def test_a_prefix_lm_prompt_adds_the_tokenizer_s_bos_as_apply_chat_template_does(paligemma, template_bos):
    """PaliGemma's processor turns its tokenizer's ``<bos>`` off; with it on, the processor's own
    ``apply_chat_template(tokenize=True)`` adds it once: before the text, unless the template already writes it."""
    descriptor, _ = paligemma
    processor = descriptor.tiny_processor()
    processor.tokenizer.add_bos_token = True
    if template_bos:
        processor.chat_template = "{{ bos_token }}" + processor.chat_template
    encoder = PromptEncoder(processor, ImageStore(), descriptor)
    image = noise_image((32, 32), 40)
    prompt = encoder.encode(ask([{"type": "image", "image": encoder.store.add(image)}]))
    own = processor_inputs(processor, ask([{"type": "image", "image": image}]))["input_ids"][0].tolist()
    bos = processor.tokenizer.bos_token_id
    assert prompt.input_ids == own and own[0] == bos and own[1] != bos
    assert prompt.text.startswith("<bos>") == template_bos


def test_where_one_placeholder_begins_with_the_other_the_longer_is_read(qwen):
    """A family whose video placeholder begins with its image placeholder: the template's video mark is one video,
    not an image followed by text."""
    descriptor, processor = qwen
    family = attrs.evolve(descriptor, video_placeholder="<|image_pad|><|video_pad|>")
    encoder = PromptEncoder(processor, ImageStore(), family)
    image_id = encoder.store.add(noise_image((64, 64), 41))
    with pytest.raises(ImageTokenError) as caught:
        encoder.tokenize("a<|image_pad|><|video_pad|>b", [image_id], "w")
    assert str(caught.value) == (
        "w: placeholder 1 is '<|image_pad|><|video_pad|>', but it stands for an image; the template reordered images "
        "and videos"
    )
