"""DeepStack's visual features added to the first text layers without the host waiting for the GPU.

transformers' Qwen3-VL text models add each DeepStack level's visual features to the hidden states at the image
tokens with boolean-mask indexing (``hidden_states[mask, :] = hidden_states[mask, :] + features``). On a GPU, indexing
by a boolean mask first counts the mask's true elements on the host, so every level stops the host until the GPU has
finished all it was given (six waits per forward at three levels, more in the backward pass when the features are
trained: the mergers are), and the GPU then idles until the host has queued more. `add_deepstack_without_waiting`
gives a loaded model's text model a ``_deepstack_process`` that finds the image tokens' positions on the GPU with
``torch.nonzero_static``, sized by the features' row count (known on the host), and then does transformers' own
gather, add and scatter with them: the same sums, in the same dtype, forward and backward.
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["add_deepstack_without_waiting", "deepstack_process"]


def deepstack_process(
    self: Any, hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor, visual_embeds: torch.Tensor
) -> torch.Tensor:
    """``hidden_states`` with ``visual_embeds`` (one row per true element of ``visual_pos_masks``, in order) added at
    the masked positions; transformers' ``_deepstack_process`` without reading the mask back to the host."""
    features = visual_embeds.to(hidden_states.device, hidden_states.dtype)
    mask = visual_pos_masks.to(hidden_states.device).reshape(-1)
    where = torch.nonzero_static(mask, size=features.shape[0]).squeeze(1)
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])
    return rows.index_put((where,), rows.index_select(0, where) + features).view_as(hidden_states)


def add_deepstack_without_waiting(model: Any) -> bool:
    """Give ``model``'s text model (``model.model.language_model``) `deepstack_process`; ``False`` when it has no
    DeepStack (Qwen2-VL, Qwen2.5-VL, Qwen3.5), which is left alone."""
    text = getattr(getattr(model, "model", None), "language_model", None)
    if text is None or not callable(getattr(type(text), "_deepstack_process", None)):
        return False
    text._deepstack_process = types.MethodType(deepstack_process, text)
    return True
