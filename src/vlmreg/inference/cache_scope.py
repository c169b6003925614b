"""`CacheScope`: the weight version a rollout request belongs to, so that a server's caches never serve work
computed with older weights.

vLLM keeps the KV of shared prompt prefixes (a system prompt, an image's tokens) and the vision encoder's output
per image. After a weight sync both are stale. Rather than clearing them (two more requests per sync), the trainer
scopes every request to the current weights: vLLM's ``cache_salt`` (prefix blocks are shared only among requests
with the same salt, so none cached under older weights is ever reused), and, when the syncs change the image side
of the model (a trained vision tower or projector), a per-version ``uuid`` on each image (vLLM keys its encoder
cache by it). Requests of one version still share prefixes and image embeddings among themselves; with the image
side frozen, an image's ``uuid`` is its content hash and its embedding is reused across versions, as it may be.
"""

from __future__ import annotations

import secrets

import attrs

__all__ = ["CacheScope"]


@attrs.define
class CacheScope:
    """``images``: the syncs change image embeddings (each version keys images apart). ``applied``: set by the
    engine that scopes its requests (`vlmreg.inference.openai_client.OpenAIEngine`); while no engine does, the
    server's caches are cleared after every sync instead. ``model``: with adapter syncs into vLLM, the current
    version's adapter, which requests name as their model."""

    images: bool = False
    applied: bool = False
    version: int = 0
    # the model name requests use, when it changes with the weights (vLLM's adapter of this version)
    model: str | None = None
    _base: str = attrs.field(factory=lambda: secrets.token_urlsafe(24), repr=False)

    @property
    def salt(self) -> str:
        """vLLM's ``cache_salt`` for requests of the current version: unguessable, so no other client shares it."""
        return f"{self._base}-{self.version}"

    def advance(self) -> None:
        """The server now holds newer weights: later requests get a new salt."""
        self.version += 1

    def image_uuid(self, image_id: str) -> str:
        """The ``uuid`` vLLM keys an image's cached embedding by (``image_id``: its content hash)."""
        return f"{image_id}-{self.salt}" if self.images else image_id
