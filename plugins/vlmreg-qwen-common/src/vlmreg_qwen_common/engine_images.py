"""The Qwen families' ``engine_image`` hook: an image sent to a rollout server at the size the trainer's processor
resizes it to (Qwen2-VL's ``smart_resize``), resized as that processor does (see `vlmreg.sdk.images`): vLLM's
torchvision-backed processor then resizes nothing, and samples from the pixels the trainer scores."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vlmreg.sdk import resized_like_processor

__all__ = ["resized_for_engine"]


def edges(image_processor: Any) -> tuple[int, int]:
    """The processor's (min_pixels, max_pixels): its ``size``'s ``shortest_edge`` and ``longest_edge``."""
    size = image_processor.size
    get: Callable[[str], Any] = size.get if isinstance(size, dict) else lambda key: getattr(size, key, None)
    return int(get("shortest_edge")), int(get("longest_edge"))


def resized_for_engine(processor: Any, image: Any) -> Any:
    # deferred: start-up cost (loads transformers)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # noqa: PLC0415

    image_processor = processor.image_processor
    low, high = edges(image_processor)
    height, width = smart_resize(
        image.height,
        image.width,
        factor=image_processor.patch_size * image_processor.merge_size,
        min_pixels=low,
        max_pixels=high,
    )
    return resized_like_processor(processor, image, height, width)
