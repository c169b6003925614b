"""What a Qwen3-generation vision encoder computes from its ``grid_thw``, computed on the host instead.

transformers' Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE vision towers derive five inputs from the images'
grids at the start of every forward: the position grid's interpolation taps and weights, the rotary position ids,
the attention segments (``cu_seqlens``) and the longest segment. On a GPU each derivation reads data back
(``repeat_interleave`` without an output size, ``.tolist()``, ``.item()``), so the host waits for the GPU some
thirteen times per micro-batch and the GPU then waits for the host. Each helper in ``transformers.vision_utils``
returns a value found in its ``kwargs`` instead of computing it; `vision_call_inputs` calls the same helpers, with
the encoder's own settings, on the grid while it is still on the host, so that the trainer can hand the results to
the encoder's call (`vlmreg.modeling.vision_calls`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["GRID_INPUTS", "vision_call_inputs"]

#: The model inputs a Qwen vision encoder is called with as its ``grid_thw``: images', then videos'.
GRID_INPUTS = ("image_grid_thw", "video_grid_thw")


def vision_call_inputs(encoder: Any, image_inputs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """For each grid among ``image_inputs`` (host tensors), the keyword arguments ``encoder``'s forward pops instead
    of deriving them from that grid: ``{grid input name: {name: value}}``. Imports transformers on call."""
    # deferred: start-up cost (loads transformers)
    from transformers.vision_utils import (  # noqa: PLC0415
        get_vision_cu_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    out: dict[str, dict[str, Any]] = {}
    for name in GRID_INPUTS:
        grid = image_inputs.get(name)
        if grid is None or grid.device.type != "cpu" or not len(grid):
            continue
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid,
            num_grid_per_side=encoder.num_grid_per_side,
            mode=encoder.interpolation_mode,
            align_corners=encoder.interpolation_align_corners,
            spatial_merge_size=encoder.config.spatial_merge_size,
        )
        cu_seqlens = get_vision_cu_seqlens(grid)
        out[name] = {
            "interp_indices": indices,
            "interp_weights": weights,
            "position_ids": get_vision_position_ids(grid, encoder.spatial_merge_size),
            "cu_seqlens": cu_seqlens,
            "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
        }
    return out
