"""A video in a chat request to vLLM, as the trainer's processor sees it: the very frames, their timing, no re-sampling.

vLLM 0.24 decodes a ``video_url`` itself: an ``http(s)``/``file`` URL or a ``data:video/mp4;base64,...`` URI goes
through its video loader (OpenCV by default), which samples its own frames (``--media-io-kwargs`` ``num_frames``,
default 32, or ``fps``), so neither the frames nor the timestamps a processor writes from them (``<t seconds>``) need
be the trainer's. One form skips the loader: ``data:video/jpeg;base64,<frame>,<frame>,...``, the frames already
extracted, each its own base64 image, joined by commas (``vllm/multimodal/media/video.py``,
``VideoMediaIO.load_base64``). vLLM
opens each frame with PIL whatever its format, so the frames go as PNG (lossless: vLLM decodes the trainer's uint8
pixels exactly), and takes the clip's metadata from the request's ``media_io_kwargs["video"]``: ``fps``,
``frames_indices``, ``total_num_frames`` and ``duration``, with ``do_sample_frames`` false, and ``num_frames`` (how
many of the comma-separated frames it keeps; 32 unless given). Its multimodal processor for a family that writes
timestamps computes them from ``frames_indices`` and ``fps`` as transformers' does, and calls the HF video processor
with ``do_sample_frames=False``: the trainer's metadata (`vlmreg.data.store.video_inputs`) reaches it unchanged.

``media_io_kwargs`` belongs to the request, not to one video: a request's videos must share their timing (frame
count, frame rate, frame indices, total frames), or `video_timing` refuses it. The frames are first put at the size
the trainer's processor resizes them to (the family's ``engine_video``), so vLLM's processor (transformers'
torchvision backend) resizes nothing. Where vLLM's prompt update drops text the processor keeps around a video's
expansion (the family's ``vllm_video_wrapper``), that text is sent around the video, so vLLM's prompt ids are the
processor's; the engine checks each video prompt vLLM returns against its own encoding. `vlmreg serve` takes the same
form (`vlmreg.serve.video_frames`) and expands videos as the processor does, so it gets no wrapper.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Sequence
from typing import Any

from vlmreg.data.store import ImageStore, StoredVideo
from vlmreg.sdk.errors import VlmregError

__all__ = [
    "VIDEO_FRAMES_MEDIA_TYPE",
    "frames_data_uri",
    "prompt_difference",
    "video_media_io_kwargs",
    "video_parts",
    "video_timing",
]

#: The media type under which vLLM takes a list of extracted frames (its name says JPEG; any format PIL opens is read)
VIDEO_FRAMES_MEDIA_TYPE = "video/jpeg"


def _png_base64(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def frames_data_uri(frames: Iterable[Any]) -> str:
    """A clip's frames (PIL) as one ``data:video/jpeg;base64,<png>,<png>,...`` URI: each frame lossless PNG."""
    return f"data:{VIDEO_FRAMES_MEDIA_TYPE};base64," + ",".join(_png_base64(frame) for frame in frames)


def video_timing(video: StoredVideo) -> tuple[int, float, tuple[int, ...], int]:
    """What a request's ``media_io_kwargs`` says of one video: its frame count, frame rate, frame indices and total
    frames."""
    return len(video.frame_ids), float(video.fps), tuple(video.frame_indices), int(video.total_frames)


def video_media_io_kwargs(timings: Iterable[tuple[int, float, tuple[int, ...], int]], where: str) -> dict[str, Any]:
    """The request's ``media_io_kwargs`` for its videos' timings (one per video, in order; all must be equal: vLLM
    takes one per request), or `VlmregError` naming ``where``."""
    distinct = list(dict.fromkeys(timings))
    if len(distinct) > 1:
        shown = "; ".join(f"{n} frames at {fps:g} fps, indices {list(ix)} of {total}" for n, fps, ix, total in distinct)
        raise VlmregError(
            f"{where}: its videos differ in timing ({shown}), but a request carries one set of media_io_kwargs (vLLM's "
            "field): give a conversation's videos the same frame count, rate and sampling, or use the embedded engine"
        )
    count, fps, indices, total = distinct[0]
    return {
        "video": {
            "num_frames": count,
            "fps": fps,
            "frames_indices": list(indices),
            "total_num_frames": total,
            "duration": total / fps,
            "do_sample_frames": False,
        }
    }


def video_frames(store: ImageStore, video: StoredVideo, processor: Any, descriptor: Any) -> list[Any]:
    """The frames a server gets for ``video``: the family's ``engine_video`` of its stored frames, or those frames."""
    frames = [store.get(frame_id) for frame_id in video.frame_ids]
    hook = getattr(descriptor, "engine_video", None)
    return list(hook(processor, frames)) if hook is not None else frames


def video_parts(
    server: str,
    store: ImageStore,
    video_id: str,
    encoder: Any,
    uris: dict[str, str],
    timings: list[tuple[int, float, tuple[int, ...], int]],
    cache_scope: Any = None,
) -> list[dict[str, Any]]:
    """The content parts that carry video ``video_id`` to ``server`` (``"vllm"``, or ``"vlmreg"``: `vlmreg serve` takes
    the same form): its ``video_url`` (the URI cached in ``uris`` by video id; a ``uuid`` from ``cache_scope`` when
    given, as images get), for vLLM between the text parts of the family's ``vllm_video_wrapper``; its timing is
    appended to ``timings``. ``encoder`` holds the trainer's ``processor`` and the family's ``descriptor``."""
    video = store.video(video_id)
    if video_id not in uris:
        uris[video_id] = frames_data_uri(video_frames(store, video, encoder.processor, encoder.descriptor))
    timings.append(video_timing(video))
    part: dict[str, Any] = {"type": "video_url", "video_url": {"url": uris[video_id]}}
    if cache_scope is not None:
        part["uuid"] = cache_scope.image_uuid(video_id)
    wrapper = getattr(encoder.descriptor, "vllm_video_wrapper", None) if server == "vllm" else None
    before, after = wrapper or ("", "")
    return [
        *([{"type": "text", "text": before}] if before else []),
        part,
        *([{"type": "text", "text": after}] if after else []),
    ]


def prompt_difference(got: Sequence[int], want: Sequence[int], tokenizer: Any) -> str | None:
    """Where a server's prompt ids ``got`` first differ from the trainer's ``want``, shown as text; ``None``: equal."""
    if list(got) == list(want):
        return None
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    around = slice(max(0, at - 3), at + 4)
    return (
        f"token {at} differs (server {tokenizer.decode(list(got[around]))!r}, processor "
        f"{tokenizer.decode(list(want[around]))!r}; {len(got)} vs {len(want)} tokens)"
    )
