"""A ``video_url`` of frames already extracted, as vLLM takes it: ``data:video/jpeg;base64,<frame>,<frame>,...`` (each
frame its own base64 image, any format PIL opens), its timing in the request's ``media_io_kwargs["video"]``.

The keys and their defaults are vLLM 0.24's (``VideoMediaIO.load_base64``): ``num_frames`` (how many of the frames
are kept, the first ones; -1: all), ``fps`` (1), ``frames_indices`` (0, 1, ...; one per frame kept),
``total_num_frames`` (the frames kept; at least that many) and ``duration``. ``do_sample_frames`` must be false: the
frames are the sampled ones, and the processor gets them with their timing as they are. Bounds: the URI's length
(``max_video_bytes``), the frames kept (``max_video_frames``) and each frame as an image (``max_image_pixels``,
``max_image_bytes``); every problem is a `RequestError` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from vlmreg.data.images import ImageError, decode_image
from vlmreg.data.video import DecodedVideo, VideoLimits
from vlmreg.sdk.errors import RequestError

__all__ = ["FRAMES_PREFIX", "MEDIA_IO_VIDEO_KEYS", "decode_frame_list", "is_frame_list"]

#: How a frame list's URI begins (vLLM's media type for it; the frames may be PNG)
FRAMES_PREFIX = "data:video/jpeg;base64,"
MEDIA_IO_VIDEO_KEYS = ("num_frames", "fps", "frames_indices", "total_num_frames", "duration", "do_sample_frames")


def is_frame_list(url: str) -> bool:
    return url[: len(FRAMES_PREFIX)].lower() == FRAMES_PREFIX


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def decode_frame_list(url: str, timing: Mapping[str, Any], limits: VideoLimits, where: str) -> DecodedVideo:
    """The frames of a ``data:video/jpeg`` URI with the timing ``timing`` (``media_io_kwargs["video"]``, checked by
    `media_io_video`) gives them."""
    if len(url) > limits.max_bytes:
        raise RequestError(where, f"the frame list is {len(url)} bytes, more than max_video_bytes ({limits.max_bytes})")
    pieces = url[len(FRAMES_PREFIX) :].split(",")
    count = timing.get("num_frames", 32)  # vLLM's default
    pieces = pieces[:count] if count > 0 else pieces
    if len(pieces) > limits.max_frames:
        raise RequestError(where, f"{len(pieces)} frames, more than max_video_frames ({limits.max_frames})")
    frames = []
    for k, piece in enumerate(pieces):
        try:
            frames.append(decode_image("data:image/png;base64," + piece, limits=limits.images, where=""))
        except ImageError as exc:
            raise RequestError(f"{where}[frame {k}]", exc.reason) from None
    indices = timing.get("frames_indices", list(range(len(frames))))
    if len(indices) != len(frames):
        raise RequestError(
            "media_io_kwargs.video.frames_indices", f"has {len(indices)} entries for the {len(frames)} frames sent"
        )
    total = timing.get("total_num_frames", len(frames))
    if total < len(frames):
        raise RequestError(
            "media_io_kwargs.video.total_num_frames", f"is {total}, fewer than the {len(frames)} frames sent"
        )
    return DecodedVideo(tuple(frames), float(timing.get("fps", 1)), total, tuple(indices))


def media_io_video(value: Any) -> dict[str, Any]:
    """A request's ``media_io_kwargs`` checked: only ``video``, with vLLM's keys and types; its ``video`` dict."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RequestError("media_io_kwargs", 'must be an object keyed by modality ({"video": {...}})')
    for key in value:
        if key != "video":
            raise RequestError(f"media_io_kwargs.{key}", "is not supported (this server takes video timing only)")
    video = value.get("video") or {}
    if not isinstance(video, Mapping):
        raise RequestError("media_io_kwargs.video", "must be an object")
    for key in video:
        if key not in MEDIA_IO_VIDEO_KEYS:
            raise RequestError(
                f"media_io_kwargs.video.{key}", f"is not supported (supported: {', '.join(MEDIA_IO_VIDEO_KEYS)})"
            )
    checks = {
        "num_frames": (lambda v: _is_int(v) and v != 0 and v >= -1, "a positive integer, or -1 for all"),
        "fps": (
            lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf,
            "a positive number",
        ),
        "frames_indices": (
            lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v),
            "a list of frame numbers",
        ),
        "total_num_frames": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
        "duration": (
            lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
            "a non-negative number",
        ),
        "do_sample_frames": (lambda v: v is False, "false: the frames sent are the sampled ones"),
    }
    for key, (ok, what) in checks.items():
        if key in video and not ok(video[key]):
            raise RequestError(f"media_io_kwargs.video.{key}", f"must be {what} (got {video[key]!r})")
    return dict(video)
