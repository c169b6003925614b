"""The vision encoder's inputs derived per grid shape and joined are transformers' helpers' results for the whole
grid (the reference: `transformers.vision_utils` called on the micro-batch's grid, as the encoder calls them)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)
from vlmreg_qwen_common.vision_inputs import vision_call_inputs


class Encoder:
    """The attributes `vision_call_inputs` reads from a Qwen3-generation vision encoder."""

    def __init__(self, side: int, mode: str, align_corners: bool, merge: int) -> None:
        self.num_grid_per_side, self.interpolation_mode, self.interpolation_align_corners = side, mode, align_corners
        self.spatial_merge_size = merge
        self.config = type("Config", (), {"spatial_merge_size": merge})()


@pytest.mark.parametrize(("mode", "align_corners"), [("bilinear", False), ("bilinear", True), ("bicubic", False)])
@pytest.mark.parametrize("dtype", [torch.long, torch.int32])
def test_joined_per_grid_inputs_equal_the_helpers_on_the_whole_grid(mode, align_corners, dtype):
    rng = random.Random(0)
    encoder = Encoder(side=48, mode=mode, align_corners=align_corners, merge=2)
    shapes = [(1, 28, 28), (1, 16, 40), (3, 12, 8), (1, 2, 2)]  # images, a 3-frame video, the smallest grid
    for _ in range(5):
        grid = torch.tensor([rng.choice(shapes) for _ in range(rng.randint(1, 7))], dtype=dtype)
        got = vision_call_inputs(encoder, {"image_grid_thw": grid, "video_grid_thw": grid.flip(0)})
        for name in ("image_grid_thw", "video_grid_thw"):
            thw = grid if name == "image_grid_thw" else grid.flip(0)
            indices, weights = get_vision_interpolation_indices_and_weights(
                thw, num_grid_per_side=48, mode=mode, align_corners=align_corners, spatial_merge_size=2
            )
            cu_seqlens = get_vision_cu_seqlens(thw)
            want = {
                "interp_indices": indices,
                "interp_weights": weights,
                "position_ids": get_vision_position_ids(thw, 2),
                "cu_seqlens": cu_seqlens,
            }
            for key, value in want.items():
                assert got[name][key].dtype == value.dtype, key
                torch.testing.assert_close(got[name][key], value, rtol=0, atol=0)
            assert got[name]["max_seqlen"] == int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def test_a_grid_on_the_gpu_or_empty_gets_nothing():
    encoder = Encoder(side=48, mode="bilinear", align_corners=False, merge=2)
    assert vision_call_inputs(encoder, {"image_grid_thw": torch.zeros(0, 3, dtype=torch.long)}) == {}
    assert vision_call_inputs(encoder, {"pixel_values": torch.zeros(4, 8)}) == {}


def test_the_joined_inputs_are_new_tensors_each_call():
    """The cached blocks are never handed out: changing one call's result leaves the next call's alone."""
    encoder = Encoder(side=48, mode="bilinear", align_corners=False, merge=2)
    grid = torch.tensor([[1, 28, 28]])
    first = vision_call_inputs(encoder, {"image_grid_thw": grid})["image_grid_thw"]
    first["interp_weights"].zero_()
    first["position_ids"].zero_()
    second = vision_call_inputs(encoder, {"image_grid_thw": grid})["image_grid_thw"]
    assert second["interp_weights"].sum() > 0 and second["position_ids"].sum() > 0
