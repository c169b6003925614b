"""Multimodal-safe truncation, and the check that image tokens and pixel tensors agree.

A sequence over ``seq_len`` is cut only where no image's tokens are split: every image whose token
block lies wholly before the cut is kept with its features, every other image is dropped with its
tokens. `check_image_tokens` runs before every forward pass and raises if tokens and images disagree.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from vlmreg.data.prompts import ImageTokenError

__all__ = ["Cut", "check_image_tokens", "image_spans", "safe_cut"]


def image_spans(input_ids: Sequence[int], image_token: int, image_tokens: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of each image's token block, in order, given each image's token count."""
    positions = [i for i, t in enumerate(input_ids) if t == image_token]
    if len(positions) != sum(image_tokens):
        raise ImageTokenError(f"{len(positions)} image tokens in the sequence, {sum(image_tokens)} expected from {len(image_tokens)} image(s)")
    spans, offset = [], 0
    for count in image_tokens:
        block = positions[offset : offset + count]
        if block and block[-1] - block[0] + 1 != count:
            raise ImageTokenError(f"an image's {count} tokens are not contiguous (positions {block[0]}..{block[-1]})")
        spans.append((block[0], block[-1] + 1) if block else (0, 0))
        offset += count
    return spans


@attrs.frozen
class Cut:
    """Where to cut: keep ``length`` tokens and the first ``images`` images."""

    length: int
    images: int


def safe_cut(input_ids: Sequence[int], image_token: int, image_tokens: Sequence[int], seq_len: int) -> Cut:
    """The longest prefix of at most ``seq_len`` tokens that splits no image."""
    if len(input_ids) <= seq_len:
        return Cut(len(input_ids), len(image_tokens))
    length, images = seq_len, 0
    for start, end in image_spans(input_ids, image_token, image_tokens):
        if end <= seq_len:
            images += 1
        else:
            length = min(length, start)  # cut before the image that would be split
            break
    return Cut(length, images)


def check_image_tokens(input_ids: Sequence[int], image_token: int, image_tokens: Sequence[int], where: str) -> None:
    """Raise `ImageTokenError` naming ``where`` unless the sequence holds exactly the given images' tokens."""
    try:
        image_spans(input_ids, image_token, image_tokens)
    except ImageTokenError as exc:
        raise ImageTokenError(f"{where}: {exc}") from None
