"""In-memory parameter names of ``Gemma3ForConditionalGeneration`` and the names its published checkpoints use.

transformers 5 nests the decoder under ``model.language_model`` and holds the SigLIP tower without its
``vision_model`` wrapper (it drops that segment on load). The published checkpoints (google/gemma-3-*-it and -pt)
keep the layout of the first release: ``language_model.model.*``, ``vision_tower.vision_model.*``,
``multi_modal_projector.*`` (and ``language_model.lm_head.*``, absent there because the head is tied). That is
what other engines (vLLM among them) load, so it is what goes on the wire. ``save_pretrained`` (transformers
5.23, measured) writes ``vision_tower.*`` without the wrapper, a layout no released checkpoint has; transformers
loads both (its SigLIP loader drops a ``vision_model.`` prefix).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

#: (in-memory prefix, checkpoint prefix), longest first where one could shadow another.
PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


def _renamed(name: str, pairs: Iterable[tuple[str, str]], what: str) -> str:
    for old, new in pairs:
        if name.startswith(old):
            return new + name[len(old) :]
    raise ValueError(f"{name!r} is not a Gemma 3 {what} name (expected one of {', '.join(old for old, _ in pairs)}...)")


def checkpoint_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """(in-memory name, tensor) -> (published checkpoint name, the same tensor); shapes do not change."""
    for name, tensor in weights:
        yield _renamed(name, PREFIXES, "in-memory parameter"), tensor


def memory_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """(published checkpoint name, tensor) -> (in-memory name, tensor): the inverse of `checkpoint_weights`."""
    inverse = tuple((new, old) for old, new in PREFIXES)
    for name, tensor in weights:
        yield _renamed(name, inverse, "checkpoint"), tensor
