"""The image budget: a conversation keeps its last K images; older image parts become a short text marker.

`apply_image_budget` is the one function that decides what a conversation looks like under
``[rollout] max_images_in_context = K``. Rollout applies it to every conversation before the engine sees it (the
messages an engine renders, and the token prompts the embedded engine extends), so the prompt tokens recorded on
each turn, from which training samples are built, are exactly the ones the policy was sampled with. Applying it
again to its own output changes nothing, so a conversation can be kept budgeted as it grows: it never holds more
than K images, however many turns it has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["IMAGE_MARKER", "VIDEO_MARKER", "apply_image_budget", "apply_media_budget", "count_images"]

#: The text part an image beyond the budget is replaced by.
IMAGE_MARKER = "[earlier image omitted]"
#: The text part a video beyond the video budget (``max_videos_in_context``) is replaced by.
VIDEO_MARKER = "[earlier video omitted]"
_MARKERS = {"image": IMAGE_MARKER, "video": VIDEO_MARKER}


def _is_image(part: Any, kind: str = "image") -> bool:
    return isinstance(part, Mapping) and part.get("type") == kind


def count_images(messages: Sequence[Mapping[str, Any]], kind: str = "image") -> int:
    """How many image parts (``kind="video"``: video parts) ``messages`` hold."""
    return sum(1 for m in messages if not isinstance(m["content"], str) for p in m["content"] if _is_image(p, kind))


def apply_media_budget(
    messages: Sequence[Mapping[str, Any]], images: int | None, videos: int | None
) -> tuple[list[Mapping[str, Any]], int, int]:
    """The image budget and the video budget together: ``messages`` with their last ``images`` images and last
    ``videos`` videos; returns the messages and how many images and videos were replaced."""
    out, dropped_images = apply_image_budget(messages, images)
    out, dropped_videos = apply_image_budget(out, videos, kind="video")
    return out, dropped_images, dropped_videos


def apply_image_budget(
    messages: Sequence[Mapping[str, Any]], keep: int | None, *, kind: str = "image"
) -> tuple[list[Mapping[str, Any]], int]:
    """``messages`` with only their last ``keep`` images (``None`` or 0: all); each earlier image part is replaced
    by the text part `IMAGE_MARKER`. Returns the messages and how many images were replaced. ``kind="video"``: the
    same for video parts, replaced by `VIDEO_MARKER`."""
    messages = list(messages)
    if not keep:
        return messages, 0
    excess = count_images(messages, kind) - keep
    if excess <= 0:
        return messages, 0
    out: list[Mapping[str, Any]] = []
    dropped = 0
    for message in messages:
        content = message["content"]
        if dropped == excess or isinstance(content, str) or not any(_is_image(p, kind) for p in content):
            out.append(message)
            continue
        parts = []
        for part in content:
            if _is_image(part, kind) and dropped < excess:
                dropped += 1
                parts.append({"type": "text", "text": _MARKERS[kind]})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, dropped
