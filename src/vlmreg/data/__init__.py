"""The multimodal data path: examples, the content-addressed image store, datasets, prompts and truncation."""

from vlmreg.data.example import Example, image_part, text_part
from vlmreg.data.store import ImageFeatures, ImageStore, image_id_of

__all__ = ["Example", "ImageFeatures", "ImageStore", "image_id_of", "image_part", "text_part"]
