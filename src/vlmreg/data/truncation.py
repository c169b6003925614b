"""Multimodal-safe truncation: a sequence is never cut inside an image's tokens.

A sequence over ``seq_len`` is cut only where no image's span is split: every image whose span lies
wholly before the cut is kept with its features, every other image is dropped with its tokens. That
tokens and images agree is checked before every forward pass (`PromptEncoder.check`).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["Cut", "safe_cut"]


@attrs.frozen
class Cut:
    """Where to cut: keep ``length`` tokens and the first ``images`` images."""

    length: int
    images: int


def safe_cut(length: int, image_spans: Sequence[tuple[int, int]], seq_len: int) -> Cut:
    """The longest prefix of at most ``seq_len`` of ``length`` tokens that splits no image span."""
    if length <= seq_len:
        return Cut(length, len(image_spans))
    keep, images = seq_len, 0
    for start, end in image_spans:
        if end <= seq_len:
            images += 1
        else:
            keep = min(keep, start)  # cut before the image that would be split
            break
    return Cut(keep, images)
