"""InternVL processors offline and without torchvision: the tiny one, and loading a checkpoint's.

``InternVLProcessor`` takes a video processor, and transformers' ``InternVLVideoProcessor`` needs torchvision
(without it the processor cannot even be built, and ``AutoProcessor`` on a checkpoint directory does not give
an ``InternVLProcessor``). vlmreg feeds images only, so `InternVLImageOnlyProcessor` is ``InternVLProcessor``
with the image processor and the tokenizer and no video processor (processors read their parts from the
``__init__`` signature). Its image processing is transformers' PIL ``GotOcr2ImageProcessorPil``, the one the
published checkpoints name (``GotOcr2ImageProcessorFast``), with ``crop_to_patches``: dynamic high resolution.

The tiny processor: tiles of 32x32 pixels (the published 448x448, scaled down), at most 4 tiles an image
(published: 12) chosen by the image's aspect ratio, plus a 32x32 thumbnail of the whole image when there is more
than one tile. A tile is 4x4 patches of 8x8 pixels, pixel-shuffled by 0.5 into 2x2 = 4 ``<IMG_CONTEXT>`` tokens
(published: 32x32 patches of 14 px into 256). So a 64x64 image is 2x2 tiles + thumbnail = 20 tokens, a 32x64
one 1x2 + 1 = 12 and a 96x32 one 3x1 + 1 = 16, each wrapped in ``<img>`` ... ``</img>``.

Its tokenizer is a small byte-level BPE shipped as an asset (``tiny_processor/``, built by
``scripts/build_tiny_tokenizer.py``, never at import time) in the manner of the published one (Qwen2.5's
tokenizer plus InternVL's ``<img>``, ``</img>``, ``<IMG_CONTEXT>``, ``<video>`` and grounding tokens, named in
``extra_special_tokens`` for the processor). The chat template is the ``-hf`` checkpoints' ChatML one: an image
renders as ``<IMG_CONTEXT>`` and a newline, and a turn ends with ``<|im_end|>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, InternVLProcessor
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from transformers.utils import is_torchvision_available

from vlmreg.sdk.processor_files import processor_class_of

TINY_PROCESSOR_DIR = Path(__file__).with_name("tiny_processor")

#: ids in the shipped tokenizer (scripts/build_tiny_tokenizer.py puts the special tokens at 0..12)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # <|endoftext|>, <|im_start|>, <|im_end|>
START_IMAGE_ID, END_IMAGE_ID, IMAGE_ID = 3, 4, 5  # <img>, </img>, <IMG_CONTEXT>
VOCAB_SIZE = 544  # len(tokenizer), the embedding size too: a random model cannot sample an id the tokenizer lacks

TILE_SIZE = 32
PATCH_SIZE = 8
MAX_TILES = 4
DOWNSAMPLE_RATIO = 0.5
TOKENS_PER_TILE = int((TILE_SIZE // PATCH_SIZE) ** 2 * DOWNSAMPLE_RATIO**2)  # 4

# The ChatML template of the InternVL3 -hf checkpoints (an image is "<IMG_CONTEXT>\n").
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class InternVLImageOnlyProcessor(InternVLProcessor):
    """``InternVLProcessor`` with its image processor and tokenizer, and no video processor."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        image_seq_length: int = 256,
        chat_template: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(
            image_processor, tokenizer, None, image_seq_length=image_seq_length, chat_template=chat_template, **kwargs
        )


def tiny_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(TINY_PROCESSOR_DIR, local_files_only=True)


def tiny_processor() -> InternVLImageOnlyProcessor:
    """32 px tiles (at most 4, plus a thumbnail), 4 ``<IMG_CONTEXT>`` tokens a tile, the shipped tokenizer."""

    image_processor = GotOcr2ImageProcessorPil(
        size={"height": TILE_SIZE, "width": TILE_SIZE},
        crop_to_patches=True,
        min_patches=1,
        max_patches=MAX_TILES,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return InternVLImageOnlyProcessor(
        image_processor=image_processor,
        tokenizer=tiny_tokenizer(),
        image_seq_length=TOKENS_PER_TILE,
        chat_template=CHAT_TEMPLATE,
    )


def engine_processor(processor: Any) -> InternVLProcessor:
    """The full ``InternVLProcessor`` an inference engine (vLLM) loads with ``AutoProcessor``: the same tokenizer,
    template, image settings and tokens per tile, plus the ``InternVLVideoProcessor`` that class saves (the tile size
    and normalisation of the image processor). Needs torchvision, as vLLM does; a clear error says so where it is
    missing. A processor that is already the full class, or not an InternVL one, is returned as it is."""
    if type(processor) is InternVLProcessor or not isinstance(processor, InternVLProcessor):
        return processor

    if not is_torchvision_available():
        raise ImportError("saving an InternVLProcessor for an inference engine needs torchvision (vLLM needs it too)")
    # deferred: needs torchvision, which the callers check for first
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor  # noqa: PLC0415

    image = processor.image_processor
    video = InternVLVideoProcessor(
        size=dict(image.size), image_mean=list(image.image_mean), image_std=list(image.image_std)
    )
    return InternVLProcessor(
        image_processor=image,
        tokenizer=processor.tokenizer,
        video_processor=video,
        image_seq_length=processor.image_seq_length,
        chat_template=processor.chat_template,
    )


def load_processor(directory: str | Path) -> InternVLImageOnlyProcessor:
    """A checkpoint's ``InternVLProcessor`` (tokenizer, chat template, image settings, ``image_seq_length``) without
    its video processor, from local files only. Refuses a directory naming another processor class."""
    named = processor_class_of(directory)
    if named not in (None, "InternVLProcessor", InternVLImageOnlyProcessor.__name__):
        raise ValueError(f"{directory}: its processor files name {named!r}, not InternVLProcessor")
    processor = InternVLImageOnlyProcessor.from_pretrained(str(directory), local_files_only=True)
    if getattr(processor, "image_processor", None) is None:
        raise ValueError(f"{directory}: no image processor could be loaded (preprocessor_config.json)")
    return processor
