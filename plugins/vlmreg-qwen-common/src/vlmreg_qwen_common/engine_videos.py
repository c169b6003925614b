"""The Qwen video processors' ``engine_video`` hook (Qwen3-VL's and Qwen2-VL's, whose ``resize`` takes the same
arguments): a video's frames sent to a rollout server at the size the trainer's processor resizes them to, resized
by that processor's own ``resize`` (its ``smart_resize`` target over the whole clip, its filter, its backend), so the
server's processor (vLLM: transformers' torchvision backend) resizes nothing and patches the very uint8 pixels the
trainer's processor patches.

A clip whose resized frames the processor would resize again (its ``smart_resize`` is not idempotent for some odd
frame counts when the pixel cap binds: it rounds the frame count up to the temporal patch) is sent as stored, and a
warning says so: the server then resizes it itself, to the same size (the same grid and prompt), with pixels that may
differ in the last bit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vlmreg.sdk import pixel_bounds

__all__ = ["frames_for_engine"]

logger = logging.getLogger(__name__)


def _resize(video_processor: Any, clip: Any) -> Any:
    """``clip`` (1, T, C, H, W) uint8, as the processor's ``_preprocess`` resizes it."""
    # deferred: start-up cost (loads transformers)
    from transformers.image_utils import SizeDict  # noqa: PLC0415

    low, high = pixel_bounds(video_processor)
    return video_processor.resize(
        videos=clip,
        size=SizeDict(shortest_edge=low, longest_edge=high),
        resample=video_processor.resample,
        factor=video_processor.patch_size * video_processor.merge_size,
        temporal_factor=video_processor.temporal_patch_size,
        cap_pixels_per_frame=getattr(video_processor, "cap_pixels_per_frame", None),
    )


def frames_for_engine(processor: Any, frames: Sequence[Any]) -> list[Any]:
    """``frames`` (PIL, one clip) at the trainer's processor's target size; the frames themselves when the processor
    does not resize them (``do_resize`` false, or already that size) or would resize the result again."""
    # deferred: start-up cost (loads numpy, PIL, torch)
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from PIL import Image  # noqa: PLC0415

    video_processor = processor.video_processor
    if not getattr(video_processor, "do_resize", True):
        return list(frames)
    array = np.stack([np.asarray(frame.convert("RGB"), dtype=np.uint8) for frame in frames])
    clip = torch.from_numpy(array).permute(0, 3, 1, 2).unsqueeze(0)  # (1, T, C, H, W), as the processor groups it
    resized = _resize(video_processor, clip)
    if resized.shape[-2:] == clip.shape[-2:]:
        return list(frames)
    if _resize(video_processor, resized).shape[-2:] != resized.shape[-2:]:
        logger.warning(
            "a %d-frame clip resized to %dx%d would be resized again by the processor; sent at its own size %dx%d "
            "(the server resizes it: its pixels may differ from the trainer's in the last bit)",
            len(frames),
            resized.shape[-1],
            resized.shape[-2],
            clip.shape[-1],
            clip.shape[-2],
        )
        return list(frames)
    out = resized[0].permute(0, 2, 3, 1).contiguous().numpy()
    return [Image.fromarray(frame) for frame in out]
