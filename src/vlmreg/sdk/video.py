"""`VideoSampling`: how frames are taken from a video (frames per second, at most how many, at most how many pixels
each).

A family's descriptor carries its default (``video_sampling``); a run's ``[data] video_fps`` / ``video_max_frames`` /
``video_max_pixels`` and a record's own ``fps`` / ``max_frames`` / ``max_pixels`` on its video part override it, field
by field, the most specific first (`VideoSampling.over`). Nothing here imports torch or PIL.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["DEFAULT_VIDEO_SAMPLING", "VideoSampling", "video_part"]


def _positive(optional_type: type[float] | type[int]) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (optional_type, int)) or value <= 0:
            raise ValueError(f"VideoSampling.{attribute.name} must be a positive number or None, got {value!r}")

    return check


@attrs.frozen(kw_only=True)
class VideoSampling:
    """``fps``: frames taken per second of video (a list of frame images is read as a video at this rate);
    ``max_frames``: at most this many frames, spread evenly over the whole video when more would be taken;
    ``max_pixels``: a frame larger than this (width x height) is scaled down, aspect kept. ``None``: not set here."""

    fps: float | None = attrs.field(default=None, validator=_positive(float))
    max_frames: int | None = attrs.field(default=None, validator=_positive(int))
    max_pixels: int | None = attrs.field(default=None, validator=_positive(int))

    def over(self, fallback: VideoSampling) -> VideoSampling:
        """These settings, each unset one taken from ``fallback``."""
        return VideoSampling(
            fps=self.fps if self.fps is not None else fallback.fps,
            max_frames=self.max_frames if self.max_frames is not None else fallback.max_frames,
            max_pixels=self.max_pixels if self.max_pixels is not None else fallback.max_pixels,
        )


#: What applies where neither the record, the run nor the family sets a value: 2 frames a second (as common video
#: processors sample), at most 32 frames, frames at their own size.
DEFAULT_VIDEO_SAMPLING = VideoSampling(fps=2.0, max_frames=32)


def video_part(video_id: str) -> dict[str, str]:
    """A message content part standing for a video held in an `ImageStore` (its frames are images there)."""
    return {"type": "video", "video": video_id}
