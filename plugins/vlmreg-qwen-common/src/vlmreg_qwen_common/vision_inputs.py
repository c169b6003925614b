"""What a Qwen3-generation vision encoder computes from its ``grid_thw``, computed on the host instead.

transformers' Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE vision towers derive five inputs from the images'
grids at the start of every forward: the position grid's interpolation taps and weights, the rotary position ids,
the attention segments (``cu_seqlens``) and the longest segment. On a GPU each derivation reads data back
(``repeat_interleave`` without an output size, ``.tolist()``, ``.item()``), so the host waits for the GPU some
thirteen times per micro-batch and the GPU then waits for the host. Each helper in ``transformers.vision_utils``
returns a value found in its ``kwargs`` instead of computing it; `vision_call_inputs` calls the same helpers, with
the encoder's own settings, on the grid while it is still on the host, so that the trainer can hand the results to
the encoder's call (`vlmreg.modeling.vision_calls`).

Building a micro-batch is host work the GPU may wait for (the first one of a step, always). The taps, weights and
position ids are per image, one row block per grid row, joined in order; a run's images share few grid shapes
(a resized 448 x 448 image is always 1 x 28 x 28), so each shape's rows are derived once (`_one_grid`, cached) and a
micro-batch's are those blocks joined: the same tensors as the helpers give for the whole grid.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

__all__ = ["GRID_INPUTS", "vision_call_inputs"]

#: The model inputs a Qwen vision encoder is called with as its ``grid_thw``: images', then videos'.
GRID_INPUTS = ("image_grid_thw", "video_grid_thw")


def vision_call_inputs(encoder: Any, image_inputs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """For each grid among ``image_inputs`` (host tensors), the keyword arguments ``encoder``'s forward pops instead
    of deriving them from that grid: ``{grid input name: {name: value}}``. Imports transformers on call."""
    # deferred: start-up cost (loads torch, transformers)
    import torch  # noqa: PLC0415
    from transformers.vision_utils import get_vision_cu_seqlens  # noqa: PLC0415

    settings = (
        int(encoder.num_grid_per_side),
        str(encoder.interpolation_mode),
        bool(encoder.interpolation_align_corners),
        int(encoder.config.spatial_merge_size),
        int(encoder.spatial_merge_size),
    )
    out: dict[str, dict[str, Any]] = {}
    for name in GRID_INPUTS:
        grid = image_inputs.get(name)
        if grid is None or grid.device.type != "cpu" or not len(grid):
            continue
        blocks = [_one_grid(tuple(row), grid.dtype, settings) for row in grid.tolist()]
        cu_seqlens = get_vision_cu_seqlens(grid)
        out[name] = {
            "interp_indices": torch.cat([b[0] for b in blocks]),
            "interp_weights": torch.cat([b[1] for b in blocks]),
            "position_ids": torch.cat([b[2] for b in blocks]),
            "cu_seqlens": cu_seqlens,
            "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
        }
    return out


@functools.lru_cache(maxsize=256)
def _one_grid(thw: tuple[int, ...], dtype: Any, settings: tuple[int, str, bool, int, int]) -> tuple[Any, Any, Any]:
    """transformers' interpolation taps, weights and rotary position ids for one grid row (read only: joined by
    `torch.cat` into new tensors, never handed out themselves)."""
    # deferred: start-up cost (loads torch, transformers)
    import torch  # noqa: PLC0415
    from transformers.vision_utils import (  # noqa: PLC0415
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    side, mode, align_corners, interpolation_merge, rotary_merge = settings
    grid = torch.tensor([thw], dtype=dtype)
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=side, mode=mode, align_corners=align_corners, spatial_merge_size=interpolation_merge
    )
    return indices, weights, get_vision_position_ids(grid, rotary_merge)
