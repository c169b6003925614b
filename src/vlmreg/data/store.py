"""`ImageStore`: images by content hash, decoded once, turned into model features once.

Samples hold image ids, never pixels. A multi-turn trajectory that shows an image again refers to the
same id, so it costs no new memory; pixel tensors for a batch are assembled from per-image features at
the last moment (`ImageStore.batch_features`). Features are computed by the family's processor from the
image alone and cached (LRU, bounded in bytes).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

__all__ = ["ImageFeatures", "ImageStore", "image_id_of", "image_token_id", "pad_token_id"]

# Processor outputs that describe tokens, not the image.
_TOKEN_KEYS = {"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"}


def image_token_id(processor: Any) -> int:
    """The id of the processor's image token (the one repeated for each image feature)."""
    return int(processor.tokenizer.convert_tokens_to_ids(processor.image_token))


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's padding id, or its end-of-text id when it has none."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def image_id_of(image: Any) -> str:
    """The content hash of an RGB PIL image: equal pixels and size give the same id."""
    digest = hashlib.sha256(f"{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()[:24]


@attrs.frozen(eq=False)
class ImageFeatures:
    """What the processor makes of one image: how many image tokens it takes, and its tensors (dim 0 per image)."""

    tokens: int
    tensors: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.element_size() * t.nelement() for t in self.tensors.values())


class ImageStore:
    """Decoded images by content hash, plus an LRU cache of their processor features."""

    def __init__(self, max_feature_bytes: int = 1 << 30) -> None:
        self._images: dict[str, Any] = {}
        self._features: OrderedDict[tuple[int, str], ImageFeatures] = OrderedDict()
        self._feature_bytes = 0
        self.max_feature_bytes = max_feature_bytes
        self.feature_computations = 0

    # -- images ---------------------------------------------------------------------------
    def add(self, image: Any) -> str:
        """Store a PIL image (converted to RGB) and return its id; an image already held is not stored again."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        key = image_id_of(image)
        self._images.setdefault(key, image)
        return key

    def get(self, image_id: str) -> Any:
        try:
            return self._images[image_id]
        except KeyError:
            raise KeyError(f"image {image_id!r} is not in the image store") from None

    def __contains__(self, image_id: object) -> bool:
        return image_id in self._images

    def __len__(self) -> int:
        return len(self._images)

    @property
    def image_bytes(self) -> int:
        """Bytes held by decoded images (RGB, 3 bytes a pixel)."""
        return sum(3 * im.width * im.height for im in self._images.values())

    @property
    def feature_bytes(self) -> int:
        """Bytes held by cached pixel tensors."""
        return self._feature_bytes

    # -- features -------------------------------------------------------------------------
    def features(self, image_id: str, processor: Any) -> ImageFeatures:
        """The processor's features for one image, computed once and cached."""
        key = (id(processor), image_id)
        cached = self._features.get(key)
        if cached is not None:
            self._features.move_to_end(key)
            return cached
        out = processor(text=[processor.image_token], images=[self.get(image_id)], return_tensors="pt")
        tokens = int((out["input_ids"] == image_token_id(processor)).sum())
        features = ImageFeatures(tokens, {k: v for k, v in out.items() if k not in _TOKEN_KEYS})
        self.feature_computations += 1
        self._features[key] = features
        self._feature_bytes += features.nbytes
        while self._feature_bytes > self.max_feature_bytes and len(self._features) > 1:
            _, old = self._features.popitem(last=False)
            self._feature_bytes -= old.nbytes
        return features

    def batch_features(self, image_ids: Sequence[str], processor: Any) -> dict[str, Any]:
        """Model inputs for images in order (repeats included), concatenated on dim 0: one slice per image."""
        import torch

        if not image_ids:
            return {}
        per_image = [self.features(i, processor).tensors for i in image_ids]
        return {key: torch.cat([f[key] for f in per_image], dim=0) for key in per_image[0]}

    def retain(self, image_ids: Iterable[str]) -> None:
        """Drop every image (and its features) not in ``image_ids``: images of finished trajectories."""
        keep = set(image_ids)
        for key in [k for k in self._images if k not in keep]:
            del self._images[key]
        for key in [k for k in self._features if k[1] not in keep]:
            self._feature_bytes -= self._features.pop(key).nbytes
