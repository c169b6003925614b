"""Qwen2.5-VL processors that work offline and without torchvision.

transformers' ``Qwen2_5_VLProcessor`` wants a video processor, and the Qwen2-VL video processor needs torchvision.
`TinyQwen2_5_VLProcessor` drops that argument (a processor reads its parts from its ``__init__`` signature) and
takes the PIL image processor, so images go through the family's own processor class. The tiny assets (1024-token
BPE, chat template, patch 16 and merge 2) are vlmreg-qwen-common's; the real checkpoints use patch 14 and CLIP
normalisation, which `load_processor` reads from their ``preprocessor_config.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from vlmreg_qwen_common.processor import TINY_PROCESSOR_DIR, full_qwen2_vl_processor
from vlmreg_qwen_common.processor import load_processor as load_qwen_processor


class TinyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` with an image processor and a tokenizer, and no video processor."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs: Any):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=chat_template, **kwargs)


def load_processor(directory: str | Path) -> TinyQwen2_5_VLProcessor:
    """Tokenizer, chat template and image-processor settings from a local directory (no network)."""
    return load_qwen_processor(directory, TinyQwen2_5_VLProcessor)


def tiny_processor() -> TinyQwen2_5_VLProcessor:
    """The processor of the bundled tiny Qwen2.5-VL models."""
    return load_processor(TINY_PROCESSOR_DIR)


def engine_processor(processor: Any) -> Any:
    """The full ``Qwen2_5_VLProcessor`` (video processor included) that vLLM loads; needs torchvision."""
    return full_qwen2_vl_processor(processor, Qwen2_5_VLProcessor)
