"""Qwen training-time hooks: 3-D M-RoPE positions, and packed sequences through the linear-attention layers."""

from __future__ import annotations

import itertools
import threading
import types
from collections.abc import Mapping
from typing import Any

import torch

_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: Prompts whose M-RoPE positions a model keeps (`mrope_position_ids`), the oldest dropped first.
_PREFIXES_KEPT = 1024
_MEDIA_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
_PREFIXES_LOCK = threading.Lock()


def mrope_position_ids(model: Any, inputs: Mapping[str, Any]) -> torch.Tensor:
    """(4, B, L) positions: row 0 the text positions transformers builds the causal mask from, rows 1-3 M-RoPE.

    One unpadded row (a packed segment, as the trainer asks for each sample) is asked of the model's
    ``get_rope_index`` up to the first text token after its last image or video only (kept on the model: a GRPO
    group's samples share their prompt). In every Qwen M-RoPE a run of text tokens takes consecutive positions,
    the same in all three rows, so the rest of the row continues from that token's position.
    """
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    types = inputs.get("mm_token_type_ids", torch.zeros_like(ids))
    text = (mask.cumsum(-1) - 1).clamp(min=0)
    media = {k: inputs[k] for k in _MEDIA_KEYS if inputs.get(k) is not None}
    vision = torch.nonzero(types[0]).flatten() if ids.shape[0] == 1 and ids.device.type == "cpu" else None
    if vision is None or not bool(mask.all()) or (len(vision) and int(vision[-1]) + 1 == ids.shape[1]):
        rope, _ = model.base_model.get_rope_index(ids, mm_token_type_ids=types, attention_mask=mask, **media)
        return torch.cat([text[None].to(rope.device), rope], dim=0)
    end = int(vision[-1]) + 2 if len(vision) else 1  # through one text token after the last image
    key = (
        ids[0, :end].numpy().tobytes(),
        types[0, :end].numpy().tobytes(),
        *(tuple(v.flatten().tolist()) for v in media.values()),
        tuple(media),
    )
    with _PREFIXES_LOCK:  # micro-batches are built on a helper thread, and an evaluation may build on another
        cache = model.base_model.__dict__.setdefault("_vlmreg_rope_prefixes", {})
        prefix = cache.get(key)
    if prefix is None:
        prefix, _ = model.base_model.get_rope_index(
            ids[:, :end], mm_token_type_ids=types[:, :end], attention_mask=mask[:, :end], **media
        )
        with _PREFIXES_LOCK:
            if len(cache) >= _PREFIXES_KEPT:
                cache.pop(next(iter(cache)))  # the oldest
            cache[key] = prefix
    rest = prefix[:, :, -1:] + torch.arange(1, ids.shape[1] - end + 1, dtype=prefix.dtype)
    return torch.cat([text[None].to(prefix.device), torch.cat([prefix, rest], dim=-1)], dim=0)


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
