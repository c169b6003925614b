"""DeepStack's visual features added to the first text layers without the host waiting for the GPU.

transformers' Qwen3-VL text models add each DeepStack level's visual features to the hidden states at the image
tokens with boolean-mask indexing (``hidden_states[mask, :] = hidden_states[mask, :] + features``). On a GPU, indexing
by a boolean mask first counts the mask's true elements on the host, so every level stops the host until the GPU has
finished all it was given (six waits per forward at three levels), and the GPU then idles until the host has queued
more. `add_deepstack_without_waiting` gives a loaded model's text model a ``_deepstack_process`` that places the
features with ``masked_scatter`` (which finds its positions on the GPU) and adds them: at every image token the same
sum, everywhere else the hidden state plus zero, so the result is exactly transformers'.
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
    mask = visual_pos_masks.to(hidden_states.device).unsqueeze(-1).expand_as(hidden_states)
    features = visual_embeds.to(hidden_states.device, hidden_states.dtype)
    return hidden_states + torch.zeros_like(hidden_states).masked_scatter(mask, features)


def add_deepstack_without_waiting(model: Any) -> bool:
    """Give ``model``'s text model (``model.model.language_model``) `deepstack_process`; ``False`` when it has no
    DeepStack (Qwen2-VL, Qwen2.5-VL, Qwen3.5), which is left alone."""
    text = getattr(getattr(model, "model", None), "language_model", None)
    if text is None or not callable(getattr(type(text), "_deepstack_process", None)):
        return False
    text._deepstack_process = types.MethodType(deepstack_process, text)
    return True
