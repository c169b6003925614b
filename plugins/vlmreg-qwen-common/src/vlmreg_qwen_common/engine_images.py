"""The Qwen families' ``engine_image`` hook: an image sent to a rollout server at the size the trainer's processor
resizes it to (Qwen2-VL's ``smart_resize``), resized as that processor does (see `vlmreg.sdk.images`): vLLM's
torchvision-backed processor then resizes nothing, and samples from the pixels the trainer scores."""

from __future__ import annotations

from typing import Any

from vlmreg.sdk import pixel_bounds, resized_like_processor

__all__ = ["resized_for_engine"]


def resized_for_engine(processor: Any, image: Any) -> Any:
    # deferred: start-up cost (loads transformers)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # noqa: PLC0415

    image_processor = processor.image_processor
    low, high = pixel_bounds(image_processor)
    height, width = smart_resize(
        image.height,
        image.width,
        factor=image_processor.patch_size * image_processor.merge_size,
        min_pixels=low,
        max_pixels=high,
    )
    return resized_like_processor(processor, image, height, width)
