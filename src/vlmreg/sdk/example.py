"""`Example`: one prompt with its images (by id in an `ImageStore`) and its answer: what a task's ``generate`` returns
and an environment's ``reset`` receives. Nothing here imports torch or PIL."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

__all__ = ["Example", "image_part", "text_part"]


def image_part(image_id: str) -> dict[str, str]:
    """A message content part standing for an image held in an `ImageStore`."""
    return {"type": "image", "image": image_id}


def text_part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def _message_tuple(messages: Iterable[Mapping[str, Any]]) -> tuple[Mapping[str, Any], ...]:
    return tuple(messages)


@attrs.frozen(eq=False)
class Example:
    """A dataset record or generated task sample, ready for an environment.

    ``messages`` are chat messages (``role``, ``content``); ``content`` is a string or a list of parts,
    ``{"type": "text", "text": ...}``, ``{"type": "image", "image": <image id>}`` or ``{"type": "video", "video":
    <video id>}`` (its frames are images of the same store). ``id`` names the
    record for error messages (``data/train.jsonl:12``, ``colour:3``). ``task`` names the task whose reward
    scores it (``None``: the run's ``[reward]``).
    """

    id: str
    messages: tuple[Mapping[str, Any], ...] = attrs.field(converter=_message_tuple)
    answer: Any
    task: str | None = None
    metadata: Mapping[str, Any] = attrs.field(factory=dict)

    def image_ids(self) -> list[str]:
        """Image ids in order of appearance (a repeated image appears each time)."""
        return [
            part["image"]
            for message in self.messages
            if not isinstance(message["content"], str)
            for part in message["content"]
            if part.get("type") == "image"
        ]

    def video_ids(self) -> list[str]:
        """Video ids in order of appearance (``{"type": "video", "video": <id>}`` parts)."""
        return [
            part["video"]
            for message in self.messages
            if not isinstance(message["content"], str)
            for part in message["content"]
            if part.get("type") == "video"
        ]
