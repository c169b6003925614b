"""Safe video decoding: a file path, an ``http(s)://`` URL, a ``data:video/...`` URI, or a list of frame images ->
the frames a `VideoSampling` takes, each an RGB PIL image, with the timing a processor needs (`DecodedVideo`).

Decoding uses PyAV (FFmpeg's libraries, bundled in its wheels). Every step is bounded as images are
(`vlmreg.data.images`): the encoded size before a byte is decoded (``max_video_bytes``; a file's size on disk, an
HTTP body as it streams, base64 from its length), the duration from the container's header (``max_video_seconds``),
each frame's pixels from the stream's header (``max_image_pixels``) before any frame is decoded, and the frames kept
(``max_video_frames``). Local paths are confined exactly as image paths are. A damaged file fails here, naming its
record, not inside a training step.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from vlmreg.data.fetch import fetch_url
from vlmreg.data.image_limits import ImageError, ImageLimits
from vlmreg.data.images import _decode_base64, _file_uri_path, _read_file, decode_image
from vlmreg.sdk.video import VideoSampling

if TYPE_CHECKING:
    from PIL import Image as PILImage

__all__ = ["DecodedVideo", "VideoLimits", "decode_video", "sample_indices"]

_URL_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_DATA_URI = re.compile(r"^data:([^,;]*)((?:;[^,;]*)*?),", re.S)


@attrs.frozen(kw_only=True)
class VideoLimits:
    """What `decode_video` accepts: ``images`` bounds each frame (pixels) and anchors and confines paths as for images;
    ``max_bytes`` the encoded video, ``max_seconds`` its duration, ``max_frames`` the frames kept."""

    images: ImageLimits = attrs.field(factory=ImageLimits)
    max_bytes: int = attrs.field(default=200_000_000, validator=attrs.validators.gt(0))
    max_seconds: float = attrs.field(default=600.0, validator=attrs.validators.gt(0))
    max_frames: int = attrs.field(default=256, validator=attrs.validators.gt(0))

    @classmethod
    def from_section(cls, section: Any, images: ImageLimits) -> VideoLimits:
        return cls(
            images=images,
            max_bytes=section.max_video_bytes,
            max_seconds=section.max_video_seconds,
            max_frames=section.max_video_frames,
        )

    @property
    def encoded(self) -> ImageLimits:
        """The image limits with this video's byte bound, for reading the encoded file, URI or HTTP body."""
        return attrs.evolve(self.images, max_bytes=self.max_bytes, kind="video", bytes_key="max_video_bytes")


@attrs.frozen(eq=False)
class DecodedVideo:
    """The sampled frames, the video's frame rate (``fps``), how many frames it has (``total_frames``) and which of
    them were taken (``frame_indices``): a processor's video metadata, from which a processor may write timestamps."""

    frames: tuple[Any, ...]
    fps: float
    total_frames: int
    frame_indices: tuple[int, ...]


def sample_indices(total: int, fps: float, sampling: VideoSampling) -> tuple[int, ...]:
    """The frames taken from a video of ``total`` frames at ``fps``: ``sampling.fps`` a second (at least one), at most
    ``sampling.max_frames``, spread evenly from the first frame to the last."""
    wanted = total if sampling.fps is None else max(1, math.floor(total / fps * sampling.fps + 1e-9))
    count = min(total, wanted, sampling.max_frames or total)
    if count == 1:
        return (0,)
    return tuple(round(i * (total - 1) / (count - 1)) for i in range(count))


def decode_video(source: Any, *, limits: VideoLimits, sampling: VideoSampling, where: str) -> DecodedVideo:
    """Decode and sample one video, or raise `ImageError` naming ``where`` and the limit or damage.

    ``source``: a list of frame images (each as `decode_image` takes it; read as a video at ``sampling.fps``), encoded
    bytes, or a string: a ``data:video/...;base64,`` URI, an ``http(s)://`` URL (only with ``allow_http``), or a path.
    """
    if isinstance(source, (list, tuple)):
        return _from_frames(source, limits, sampling, where)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if len(data) > limits.max_bytes:
            raise ImageError(where, f"video is {len(data)} bytes, more than max_video_bytes ({limits.max_bytes})")
    elif isinstance(source, str):
        data = _read_string(source, limits, where)
    else:
        raise ImageError(
            where, f"expected a video (path, URL, data: URI or list of frames), got {type(source).__name__}"
        )
    return _decode_container(data, limits, sampling, where)


def _from_frames(frames: Sequence[Any], limits: VideoLimits, sampling: VideoSampling, where: str) -> DecodedVideo:
    if not frames:
        raise ImageError(where, "a video given as frames needs at least one frame")
    fps = sampling.fps or 1.0
    indices = sample_indices(len(frames), fps, VideoSampling(max_frames=sampling.max_frames))
    _check_frames(len(indices), limits, where)
    decoded = tuple(
        _scaled(decode_image(frames[i], limits=limits.images, where=f"{where}[{i}]"), sampling) for i in indices
    )
    return DecodedVideo(decoded, fps, len(frames), indices)


def _check_frames(count: int, limits: VideoLimits, where: str) -> None:
    if count > limits.max_frames:
        raise ImageError(
            where,
            f"video would keep {count} frames, more than max_video_frames ({limits.max_frames}); lower max_frames or "
            "fps",
        )


def _read_string(text: str, limits: VideoLimits, where: str) -> bytes:
    encoded = limits.encoded
    if text.startswith("data:"):
        match = _DATA_URI.match(text[:512])
        if not match:
            raise ImageError(where, "malformed data: URI (expected data:video/<type>;base64,<data>)")
        mime, params = match.group(1).strip().lower(), [p.strip() for p in match.group(2).lower().split(";")]
        if mime and not mime.startswith("video/"):
            raise ImageError(where, f"data: URI has media type {mime!r}, not a video type")
        if "base64" not in params:
            raise ImageError(where, "data: URI is not base64-encoded (expected ;base64,)")
        return _decode_base64(text[match.end() :], encoded, where)
    scheme = _URL_SCHEME.match(text)
    if scheme and scheme.group(1).lower() != "file":
        return fetch_url(text, scheme.group(1).lower(), encoded, where)
    if scheme:  # file:// is read as the local path it names, under the same confinement
        text = _file_uri_path(text, where)
    return _read_file(text, encoded, where)


def _decode_container(data: bytes, limits: VideoLimits, sampling: VideoSampling, where: str) -> DecodedVideo:
    # deferred: start-up cost (loads av and FFmpeg's libraries; image-only runs never need them)
    import av  # noqa: PLC0415

    if not data:
        raise ImageError(where, "empty video data")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise ImageError(where, f"not a video FFmpeg can read ({_describe(exc)})") from None
    with container:
        if not container.streams.video:
            raise ImageError(where, "the file has no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > limits.images.max_pixels:
            raise ImageError(
                where,
                f"video frames are {width}x{height} = {width * height} pixels, more than max_image_pixels "
                f"({limits.images.max_pixels})",
            )
        rate = stream.average_rate or stream.guessed_rate
        if not rate or float(rate) <= 0:
            raise ImageError(where, "the video stream has no frame rate")
        fps = float(rate)
        seconds = (
            float(stream.duration * stream.time_base)
            if stream.duration and stream.time_base is not None
            else (container.duration or 0) / av.time_base
        )
        if seconds > limits.max_seconds:
            raise ImageError(
                where, f"video is {seconds:.1f} s long, more than max_video_seconds ({limits.max_seconds:g})"
            )
        total = stream.frames or round(seconds * fps)
        if total <= 0:
            raise ImageError(where, "the video's header gives neither its frame count nor its duration")
        indices = sample_indices(total, fps, sampling)
        _check_frames(len(indices), limits, where)
        frames = _decode_frames(container, stream, set(indices), max(indices), where)
    if len(frames) < len(indices):
        raise ImageError(
            where,
            f"damaged video: it ended after {len(frames)} of the {len(indices)} sampled frames its header promises "
            f"({total} frames)",
        )
    return DecodedVideo(tuple(_scaled(f, sampling) for f in frames), fps, total, indices)


def _decode_frames(container: Any, stream: Any, wanted: set[int], last: int, where: str) -> list[Any]:
    # deferred: start-up cost (loads av and FFmpeg's libraries; image-only runs never need them)
    import av  # noqa: PLC0415

    frames = []
    try:
        for number, frame in enumerate(container.decode(stream)):
            if number in wanted:
                frames.append(frame.to_image().convert("RGB"))
            if number >= last:
                break
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise ImageError(
            where, f"damaged video: decoding failed after {len(frames)} sampled frames ({_describe(exc)})"
        ) from None
    return frames


def _scaled(image: PILImage.Image, sampling: VideoSampling) -> PILImage.Image:
    """``image`` scaled down (aspect kept, bicubic) to at most ``sampling.max_pixels``; unchanged when within it."""
    limit = sampling.max_pixels
    if limit is None or image.width * image.height <= limit:
        return image
    # deferred: start-up cost (loads PIL)
    from PIL import Image  # noqa: PLC0415

    scale = math.sqrt(limit / (image.width * image.height))
    size = (max(1, math.floor(image.width * scale)), max(1, math.floor(image.height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


def _describe(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
