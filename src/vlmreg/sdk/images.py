"""Helpers for a family's ``engine_image`` hook (`FamilyDescriptor.engine_image`): an image resized beforehand the way
the trainer's processor resizes it, so a rollout server whose processor resizes otherwise (transformers' torchvision
backend, which vLLM's ``AutoProcessor`` takes where torchvision is installed, differs from the PIL backend the
trainer uses by one level in some 0.5% of an odd-sized image's values) sees the trainer's pixels: resizing an image
to the size it already has is the identity in both backends, and in the trainer's processor."""

from __future__ import annotations

from typing import Any

__all__ = ["pixel_bounds", "resized_like_processor"]


def pixel_bounds(image_processor: Any) -> tuple[int, int]:
    """A ``smart_resize`` processor's (min_pixels, max_pixels): its ``size``'s ``shortest_edge`` and ``longest_edge``
    (a dict or transformers' ``SizeDict``)."""
    size = image_processor.size
    if isinstance(size, dict):
        return int(size["shortest_edge"]), int(size["longest_edge"])
    return int(size.shortest_edge), int(size.longest_edge)


def resized_like_processor(processor: Any, image: Any, height: int, width: int) -> Any:
    """``image`` (PIL) at ``height`` x ``width``, resized with PIL and the processor's image processor's ``resample``
    filter (bicubic when it names none), as transformers' PIL backend resizes it; ``image`` itself when it is already
    that size or the processor does not resize (``do_resize`` false)."""
    # deferred: start-up cost (loads PIL)
    from PIL import Image  # noqa: PLC0415

    image_processor = getattr(processor, "image_processor", processor)
    if not getattr(image_processor, "do_resize", True) or (image.height, image.width) == (height, width):
        return image
    resample = getattr(image_processor, "resample", None)
    filter_ = Image.Resampling(int(resample)) if resample is not None else Image.Resampling.BICUBIC
    return image.convert("RGB").resize((width, height), resample=filter_)
