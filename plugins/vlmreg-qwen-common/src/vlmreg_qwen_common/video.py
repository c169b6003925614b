"""Qwen video processors that run without torchvision.

transformers' video processors do their resizing, grayscale conversion and normalisation with torchvision, which
cannot be installed beside CPU torch here. `torch_only` gives a video processor class those three steps in plain
torch, placed right before transformers' torchvision backend in the method order, so the family's own code (frame
grouping, ``smart_resize``, patchifying, the grids, the timestamps the processor writes) runs unchanged:

- resizing: ``torch.nn.functional.interpolate`` with the same mode and antialiasing torchvision's tensor resize uses
  (uint8 frames are resized in float, rounded and clamped back, as torchvision does for bicubic);
- grayscale to RGB: the channel repeated;
- normalisation: ``(x - mean) / std`` per channel.

Values can differ from torchvision's in the last bit of a resized pixel; frames whose size ``smart_resize`` keeps
are not resized at all, and then the output is the real processor's exactly. With torchvision present (the GPU
machine, vLLM) the family's real video processor is used (`engine_processor`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.image_processing_backends import TorchvisionBackend

__all__ = ["torch_only"]

_MODES = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # PIL resample codes -> interpolate modes


class _TorchResize(TorchvisionBackend):
    """What a video processor needs of torchvision, in plain torch."""

    def resize(
        self, image: torch.Tensor, size: Any, resample: Any = None, antialias: bool = True, **kwargs: Any
    ) -> torch.Tensor:
        if not (size.height and size.width):
            raise ValueError(f"the torch-only video resize takes an exact height and width, got {size}")
        code = int(getattr(resample, "value", resample)) if resample is not None else 2
        if code not in _MODES:
            raise ValueError(
                f"the torch-only video resize has no mode for PIL resample {resample!r}; use bilinear or bicubic"
            )
        mode = _MODES[code]
        if tuple(image.shape[-2:]) == (size.height, size.width):
            return image
        shape = image.shape
        flat = image.reshape(-1, *shape[-3:])
        out = F.interpolate(
            flat.float(),
            size=(size.height, size.width),
            mode=mode,
            antialias=antialias and mode != "nearest",
            align_corners=False if mode != "nearest" else None,
        )
        if image.dtype == torch.uint8:
            out = out.round_().clamp_(0, 255).to(torch.uint8)
        return out.reshape(*shape[:-2], size.height, size.width)

    def normalize(self, image: torch.Tensor, mean: Any, std: Any, inplace: bool = False, **kwargs: Any) -> torch.Tensor:
        mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device).reshape(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype, device=image.device).reshape(-1, 1, 1)
        return (image - mean) / std


def _convert_to_rgb(self: Any, video: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """(..., C, H, W) frames as RGB: a gray channel repeated, an alpha channel dropped (the video processor's own
    method, which calls torchvision, is replaced by this one)."""
    if video.shape[-3] == 1:
        return video.expand(*video.shape[:-3], 3, *video.shape[-2:]).contiguous()
    if video.shape[-3] == 4:
        return video[..., :3, :, :]
    return video


_TORCH_ONLY: dict[type, type] = {}


def torch_only(video_processor_class: type[Any]) -> type[Any]:
    """``video_processor_class`` (a transformers video processor) resizing and normalising in plain torch: built
    once."""
    if video_processor_class not in _TORCH_ONLY:
        name = f"TorchOnly{video_processor_class.__name__}"
        _TORCH_ONLY[video_processor_class] = type(
            name,
            (video_processor_class, _TorchResize),
            {
                "__module__": __name__,
                "__qualname__": name,
                "convert_to_rgb": _convert_to_rgb,
                "__doc__": f"``{video_processor_class.__name__}`` without torchvision (see "
                "`vlmreg_qwen_common.video`).",
            },
        )
    return _TORCH_ONLY[video_processor_class]
