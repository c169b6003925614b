"""Qwen training-time hooks: 3-D M-RoPE positions, and packed sequences through the linear-attention layers."""

from __future__ import annotations

import itertools
import types
from collections.abc import Mapping
from typing import Any

import torch

_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def mrope_position_ids(model: Any, inputs: Mapping[str, Any]) -> torch.Tensor:
    """(4, B, L) positions: row 0 the text positions transformers builds the causal mask from, rows 1-3 M-RoPE."""
    rope, _ = model.base_model.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs.get("mm_token_type_ids", torch.zeros_like(inputs["input_ids"])),
        image_grid_thw=inputs.get("image_grid_thw"),
        attention_mask=inputs["attention_mask"],
        **{k: inputs[k] for k in ("video_grid_thw", "second_per_grid_ts") if inputs.get(k) is not None},
    )
    text = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return torch.cat([text[None].to(rope.device), rope], dim=0)


def _segmented_forward(
    self: Any, hidden_states: torch.Tensor, cache_params: Any = None, attention_mask: Any = None, **kwargs: Any
) -> torch.Tensor:
    original = type(self).forward
    lengths = kwargs.get("cu_seq_lens_q")
    rest = {k: v for k, v in kwargs.items() if k not in _PACKING_KEYS}
    if lengths is None or cache_params is not None or hidden_states.shape[0] != 1 or len(lengths) <= 2:
        return original(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **rest)
    bounds = lengths.tolist()
    parts = [
        original(self, hidden_states[:, a:b], cache_params=None, attention_mask=None, **rest)
        for a, b in itertools.pairwise(bounds)
    ]
    return torch.cat(parts, dim=1)


def segment_linear_attention(model: Any) -> None:
    """Make Gated DeltaNet layers run each packed segment on its own (their recurrent state and causal conv
    would otherwise carry over from one sample into the next). Full-attention layers already get a
    block-diagonal mask from the per-segment positions. The method is bound to each module, so a copy of
    the model (``copy.deepcopy``) gets methods bound to its own modules."""

    for module in model.modules():
        if type(module).__name__.endswith("GatedDeltaNet") and not getattr(module, "_vlmreg_segmented", False):
            module.forward = types.MethodType(_segmented_forward, module)
            module._vlmreg_segmented = True
