"""In-memory parameter names of ``InternVLForConditionalGeneration`` and the names its published checkpoints use.

transformers 5 nests the decoder under ``model.language_model`` and the vision tower and projector under
``model.``. The published ``-hf`` checkpoints (OpenGVLab/InternVL3-{1,2,8,14,38,78}B-hf, and the InternVL3.5
``-HF`` ones) were written by transformers 4.5x's ``save_pretrained``, which wrote the layout of the first LLaVA
release: ``language_model.model.*``, ``language_model.lm_head.weight``, ``vision_tower.*`` (embeddings,
``encoder.layer.{i}.attention.{q,k,v}_proj``, ``lambda_1``, ...) and ``multi_modal_projector.*``
(``layer_norm``, ``linear_1``, ``linear_2``). transformers 5 loads that through its ``llava`` conversion
mapping (``internvl`` uses it), vLLM maps it too, and transformers 5.23's own ``save_pretrained`` still writes
it; so it is what goes on the wire. Shapes do not change.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

#: (in-memory prefix, checkpoint prefix).
PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


def _renamed(name: str, pairs: Iterable[tuple[str, str]], what: str) -> str:
    for old, new in pairs:
        if name.startswith(old):
            return new + name[len(old) :]
    raise ValueError(f"{name!r} is not an InternVL {what} name (expected one of {', '.join(old for old, _ in pairs)}...)")


def checkpoint_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """(in-memory name, tensor) -> (published checkpoint name, the same tensor)."""
    for name, tensor in weights:
        yield _renamed(name, PREFIXES, "in-memory parameter"), tensor


def memory_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """(published checkpoint name, tensor) -> (in-memory name, tensor): the inverse of `checkpoint_weights`."""
    inverse = tuple((new, old) for old, new in PREFIXES)
    for name, tensor in weights:
        yield _renamed(name, inverse, "checkpoint"), tensor
