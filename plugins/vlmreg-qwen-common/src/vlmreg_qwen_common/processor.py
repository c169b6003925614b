"""Qwen processors that work offline and without torchvision.

``Qwen3VLProcessor`` insists on a video processor, which needs torchvision. This subclass drops the
``video_processor`` argument (processors read their parts from the ``__init__`` signature) and uses the
PIL image processor. ``AutoProcessor`` without torchvision silently returns only a tokenizer, so
`load_processor` builds the processor explicitly and checks it has its image processor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

TINY_PROCESSOR_DIR = Path(__file__).with_name("tiny_processor")


class TinyQwenProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` with an image processor and a tokenizer, and no video processor."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs: Any):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=chat_template, **kwargs)


def load_processor(directory: str | Path) -> TinyQwenProcessor:
    """Load tokenizer, chat template and image-processor settings from a local directory (no network)."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(directory, local_files_only=True)
    chat_template = None
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
        chat_template = template_file.read_text()
    return TinyQwenProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template or tokenizer.chat_template)


def tiny_processor() -> TinyQwenProcessor:
    """The processor of the bundled tiny Qwen models: 1024-token BPE, patch 16, merge 2."""
    return load_processor(TINY_PROCESSOR_DIR)
