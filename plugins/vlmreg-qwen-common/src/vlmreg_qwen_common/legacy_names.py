"""Checkpoint names of the Qwen2-VL / Qwen2.5-VL layout: ``visual.*`` and ``model.*`` at the top level.

transformers 5 holds these models as ``model.visual.*`` and ``model.language_model.*`` in memory, but the
published checkpoints (and what ``save_pretrained`` writes) keep the older layout, which vLLM's loader expects too::

    in memory                                   checkpoint
    model.visual.blocks.0.attn.qkv.weight       visual.blocks.0.attn.qkv.weight
    model.language_model.layers.0.mlp.*         model.layers.0.mlp.*
    model.language_model.embed_tokens.weight    model.embed_tokens.weight
    lm_head.weight                              lm_head.weight

`legacy_checkpoint_names` and `memory_names` are the descriptor's ``checkpoint_weights`` / ``memory_weights``
for such families. Tensors pass through untouched (names only); no torch import.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["legacy_checkpoint_names", "memory_names"]

_VISUAL, _LANGUAGE = "model.visual.", "model.language_model."


def legacy_checkpoint_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """In-memory (name, tensor) pairs to the published checkpoint names."""
    for name, tensor in weights:
        if name.startswith(_VISUAL):
            yield "visual." + name[len(_VISUAL) :], tensor
        elif name.startswith(_LANGUAGE):
            yield "model." + name[len(_LANGUAGE) :], tensor
        else:
            yield name, tensor


def memory_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Checkpoint (name, tensor) pairs back to in-memory names; in-memory names pass through unchanged."""
    for name, tensor in weights:
        if name.startswith("visual."):
            yield "model." + name, tensor
        elif name.startswith("model.") and not name.startswith((_VISUAL, _LANGUAGE)):
            yield _LANGUAGE + name[len("model.") :], tensor
        else:
            yield name, tensor
