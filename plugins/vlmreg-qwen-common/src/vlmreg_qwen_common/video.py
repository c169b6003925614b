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

``Qwen2VLVideoProcessor`` (Qwen2-VL and Qwen2.5-VL) lives in a module that imports torchvision's functional
transforms at its top, for type annotations only (strings its code never evaluates). `qwen2_vl_video_processor_class`
imports that module with an empty stand-in for ``torchvision.transforms.v2.functional`` present during the import
alone (removed right after, so ``is_torchvision_available()`` and every later import see no torchvision): the class is
transformers' own, its code unchanged, and `torch_only` gives it the three steps above.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F
from transformers.image_processing_backends import TorchvisionBackend
from transformers.utils import is_torchvision_available

__all__ = ["qwen2_vl_video_processor_class", "torch_only"]

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


_QWEN2_VL_VIDEO_MODULE = "transformers.models.qwen2_vl.video_processing_qwen2_vl"
#: what that module imports (``import torchvision.transforms.v2.functional as tvF``), parents first
_TORCHVISION_FUNCTIONAL = (
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
)


def qwen2_vl_video_processor_class() -> type[Any]:
    """transformers' ``Qwen2VLVideoProcessor``; without torchvision, imported with an empty stand-in for the
    torchvision module its annotations name, present only during that import (see the module docstring)."""
    if is_torchvision_available() or _QWEN2_VL_VIDEO_MODULE in sys.modules:
        return importlib.import_module(_QWEN2_VL_VIDEO_MODULE).Qwen2VLVideoProcessor
    stand_ins = {name: types.ModuleType(name) for name in _TORCHVISION_FUNCTIONAL}
    for parent, child in zip(_TORCHVISION_FUNCTIONAL, _TORCHVISION_FUNCTIONAL[1:], strict=False):
        setattr(stand_ins[parent], child.rsplit(".", 1)[1], stand_ins[child])
    taken = [name for name in _TORCHVISION_FUNCTIONAL if name in sys.modules]
    if taken:
        raise ImportError(
            f"{taken[0]} is imported but transformers finds no torchvision; cannot load {_QWEN2_VL_VIDEO_MODULE}"
        )
    sys.modules.update(stand_ins)
    try:
        module = importlib.import_module(_QWEN2_VL_VIDEO_MODULE)
    finally:
        for name in _TORCHVISION_FUNCTIONAL:
            if sys.modules.get(name) is stand_ins[name]:
                del sys.modules[name]
    return module.Qwen2VLVideoProcessor
