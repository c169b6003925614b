"""Chat messages with image ids -> token ids whose image tokens match the images' features exactly.

The chat template renders one image token per image; each is expanded to as many tokens as the
processor gives that image (known from the `ImageStore`, computed once per image), and the text is
tokenized without the images. This is what the processor itself does, without re-processing pixels
on every turn; `tests/data/test_prompts.py` checks both paths agree for every bundled family.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from vlmreg.data.store import ImageStore, image_token_id
from vlmreg.sdk.errors import VlmregError

__all__ = ["EncodedPrompt", "ImageTokenError", "encode_messages", "image_token_id", "template_messages"]


class ImageTokenError(VlmregError):
    """Image tokens and image features disagree (a template or truncation dropped or duplicated an image)."""


@attrs.frozen
class EncodedPrompt:
    """Token ids of a rendered conversation, the images in the order their tokens appear, and their token counts."""

    input_ids: list[int]
    image_ids: list[str]
    image_tokens: list[int]
    text: str


def vision_token_ids(processor: Any, descriptor: Any) -> tuple[int, ...]:
    """Ids of the family's vision special tokens: generated text must never contain them (they would claim
    image features that do not exist), so the sampler and the trainer give them no probability."""
    tokens = {processor.image_token}
    if descriptor.vision_tokens is not None:
        tokens |= {t for t in attrs.astuple(descriptor.vision_tokens) if t}
    tokenizer = processor.tokenizer
    ids = {tokenizer.convert_tokens_to_ids(t) for t in tokens}
    return tuple(sorted(i for i in ids if i is not None and i != tokenizer.unk_token_id))


def template_messages(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Messages as chat templates expect them (``{"type": "image"}`` parts) and the image ids in order."""
    out, image_ids = [], []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        parts = []
        for part in content:
            if part.get("type") == "image":
                image_ids.append(part["image"])
                parts.append({"type": "image"})
            else:
                parts.append(dict(part))
        out.append({"role": message["role"], "content": parts})
    return out, image_ids


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    processor: Any,
    store: ImageStore,
    *,
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
    where: str = "prompt",
) -> EncodedPrompt:
    """Render and tokenize a conversation; image tokens are expanded per image and checked against the images."""
    chat, image_ids = template_messages(messages)
    text = processor.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False, **(template_kwargs or {}))
    token = processor.image_token
    pieces = text.split(token)
    if len(pieces) - 1 != len(image_ids):
        raise ImageTokenError(
            f"{where}: the chat template rendered {len(pieces) - 1} image token(s) for {len(image_ids)} image(s); "
            "an image would be dropped or duplicated"
        )
    counts = [store.features(image_id, processor).tokens for image_id in image_ids]
    expanded = pieces[0] + "".join(token * n + piece for n, piece in zip(counts, pieces[1:], strict=True))
    ids = processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    found = sum(1 for t in ids if t == image_token_id(processor))
    if found != sum(counts):
        raise ImageTokenError(f"{where}: {found} image tokens after tokenizing, {sum(counts)} expected from {len(image_ids)} image(s)")
    return EncodedPrompt(input_ids=list(ids), image_ids=image_ids, image_tokens=counts, text=text)
