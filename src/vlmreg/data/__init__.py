"""The multimodal data path: examples, the content-addressed image store, datasets, prompts and truncation."""

from vlmreg.data.datasets import DataError, LoadedData, SkippedRecord, load_examples
from vlmreg.data.images import ImageError, ImageLimits, decode_image
from vlmreg.data.store import ImageFeatures, ImageStore, image_id_of
from vlmreg.sdk.example import Example, image_part, text_part

__all__ = [
    "DataError",
    "Example",
    "ImageError",
    "ImageFeatures",
    "ImageLimits",
    "ImageStore",
    "LoadedData",
    "SkippedRecord",
    "decode_image",
    "image_id_of",
    "image_part",
    "load_examples",
    "text_part",
]
