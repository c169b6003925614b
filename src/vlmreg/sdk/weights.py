"""`PrefixRenames`: checkpoint names that differ from the in-memory ones by their prefixes only.

Many families' published checkpoints keep an older module layout than transformers 5 holds in memory (the decoder
under ``language_model.model.`` on disk, ``model.language_model.`` in memory, say). A family declares the pairs once::

    RENAMES = PrefixRenames((("model.language_model.", "language_model.model."), ("lm_head.",
    "language_model.lm_head.")),
                            label="a My-VLM")
    FamilyDescriptor(..., checkpoint_weights=RENAMES.checkpoint_weights, memory_weights=RENAMES.memory_weights)

Each name must start with one of the prefixes (the first that matches wins, so list a longer prefix before one it
extends); a name that starts with none is an error naming the family (``label``), since sending it under a name no
checkpoint has would fail only inside the inference engine. Tensors pass through untouched; nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import attrs

__all__ = ["PrefixRenames"]


def _pairs(value: Any) -> tuple[tuple[str, str], ...]:
    pairs = tuple((str(a), str(b)) for a, b in value)
    if not pairs or any(not a or not b for a, b in pairs):
        raise ValueError("PrefixRenames needs (in-memory prefix, checkpoint prefix) pairs of non-empty strings")
    return pairs


@attrs.frozen
class PrefixRenames:
    """(in-memory prefix, checkpoint prefix) pairs, and the two directions of the mapping they define; ``label`` names
    the family in errors, article included (``"a My-VLM"``: "... is not a My-VLM checkpoint name")."""

    pairs: tuple[tuple[str, str], ...] = attrs.field(converter=_pairs)
    label: str = "this family's"

    def checkpoint_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """(in-memory name, tensor) -> (published checkpoint name, the same tensor)."""
        for name, tensor in weights:
            yield self._renamed(name, self.pairs, "in-memory parameter"), tensor

    def memory_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """(published checkpoint name, tensor) -> (in-memory name, tensor): the inverse of `checkpoint_weights`."""
        inverse = tuple((new, old) for old, new in self.pairs)
        for name, tensor in weights:
            yield self._renamed(name, inverse, "checkpoint"), tensor

    def _renamed(self, name: str, pairs: tuple[tuple[str, str], ...], what: str) -> str:
        for old, new in pairs:
            if name.startswith(old):
                return new + name[len(old) :]
        raise ValueError(
            f"{name!r} is not {self.label} {what} name (expected one of {', '.join(old for old, _ in pairs)}...)"
        )
