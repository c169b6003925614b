"""LLaVA-OneVision processors that work offline and without torchvision: the tiny one, and a checkpoint's.

``LlavaOnevisionProcessor`` takes a video processor, and transformers' ``LlavaOnevisionVideoProcessor`` needs
torchvision. vlmreg feeds images only, so `LlavaOnevisionImageOnlyProcessor` is that processor with its image
processor and tokenizer and no video processor (a processor's parts are read from its ``__init__`` signature).

Images: transformers' PIL ``LlavaOnevisionImageProcessorPil`` (anyres). An image is resized into the best of the
``image_grid_pinpoints`` for its aspect ratio, padded, cut into tiles of the vision tower's input size, and preceded
by the whole image resized to one tile. The model packs the tiles' features (one row of ``image_newline`` after each
row of patches, padding rows/columns removed, shrunk when over ``anyres_max_9``), so the token count depends on the
image's size; the processor computes the same count (``_get_number_of_features``).

One choice differs from transformers' processor, on purpose: transformers tiles an image only when it is the only
image of its sample (several images get one tile each, padded square, and ``batch_num_images`` tells the model).
vlmreg expands each image alone (docs/reference.md, the processor contract), and vLLM's LLaVA-OneVision tiles every
image whatever the count, so `PerImageAnyresImageProcessor` tiles every image: ``batch_num_images`` is 1 for each
image, and the model (which reads it) agrees. For single-image prompts, the published tasks, nothing changes.

The tiny processor: tiles of 24x24 pixels (published: 384), 8 px patches, so 3x3 = 9 features a tile (published
27x27 = 729), pinpoints up to 2x2 tiles (also 1x3 and 3x1), ``vision_feature_select_strategy="full"`` and
``anyres_max_9`` as published. A 64x64 image becomes 1 + 2x2 tiles and 9 + 6x6 + 6 = 51 ``<image>`` tokens; a
32x64 (w x h) one 1 + 2x1 tiles and 9 + 6x3 + 6 = 33; a 96x32 one 1 + 1x3 tiles and 9 + 3x9 + 3 = 39.

Its tokenizer is a small byte-level BPE shipped as an asset (``tiny_processor/``, built by
``scripts/build_tiny_tokenizer.py``, never at import time) like the published one: Qwen2's tokenizer with
``<image>`` and ``<video>`` added and named for the processor. The chat template is ChatML: an image renders as
``<image>`` and a newline, a turn ends with ``<|im_end|>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, LlavaOnevisionProcessor
from transformers.image_processing_backends import PilBackend
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil
from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor
from transformers.utils import is_torchvision_available

from vlmreg.sdk.processor_files import chat_template_of, processor_class_of

TINY_PROCESSOR_DIR = Path(__file__).with_name("tiny_processor")

#: ids in the shipped tokenizer (scripts/build_tiny_tokenizer.py puts the special tokens at 0..4)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # <|endoftext|>, <|im_start|>, <|im_end|>
IMAGE_ID, VIDEO_ID = 3, 4  # <image>, <video>
VOCAB_SIZE = 538  # len(tokenizer), and the embedding size: a random model cannot sample an id the tokenizer lacks

TILE_SIZE = 24
PATCH_SIZE = 8
FEATURES_PER_TILE = (TILE_SIZE // PATCH_SIZE) ** 2  # 9
#: (height, width) resolutions an image may be tiled into: 1x1, 1x2, 2x1, 2x2, 1x3 and 3x1 tiles.
GRID_PINPOINTS = [[24, 24], [24, 48], [48, 24], [48, 48], [24, 72], [72, 24]]
VISION_ASPECT_RATIO = "anyres_max_9"

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class PerImageAnyresImageProcessor(LlavaOnevisionImageProcessorPil):
    """``LlavaOnevisionImageProcessorPil`` that tiles every image (anyres) however many share a sample: each image
    counts as a sample of one in ``batch_num_images``, so its tensors and tokens are what it gets alone."""

    def preprocess(self, images: Any, **kwargs: Any) -> Any:
        if isinstance(images, (list, tuple)):
            flat = [im for item in images for im in (item if isinstance(item, (list, tuple)) else [item])]
        else:
            flat = [images]
        return PilBackend.preprocess(self, flat, [1] * len(flat), **kwargs)


class LlavaOnevisionImageOnlyProcessor(LlavaOnevisionProcessor):
    """``LlavaOnevisionProcessor`` with its image processor and tokenizer, and no video processor."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        num_image_tokens: int | None = None,
        vision_feature_select_strategy: str | None = None,
        chat_template: str | dict[str, str] | None = None,
        vision_aspect_ratio: str = "anyres_max_9",
        **kwargs: Any,
    ):
        super().__init__(
            image_processor,
            tokenizer,
            None,
            num_image_tokens=num_image_tokens,
            vision_feature_select_strategy=vision_feature_select_strategy,
            chat_template=chat_template,
            vision_aspect_ratio=vision_aspect_ratio,
            **kwargs,
        )


def tiny_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(TINY_PROCESSOR_DIR, local_files_only=True)


def tiny_image_processor() -> PerImageAnyresImageProcessor:
    return PerImageAnyresImageProcessor(
        size={"height": TILE_SIZE, "width": TILE_SIZE},
        image_grid_pinpoints=[list(p) for p in GRID_PINPOINTS],
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],  # SigLIP's, as published
    )


def tiny_processor() -> LlavaOnevisionImageOnlyProcessor:
    """24 px tiles in 8 px patches (9 features a tile), anyres up to 2x2 / 1x3 tiles, the shipped tokenizer."""
    return LlavaOnevisionImageOnlyProcessor(
        image_processor=tiny_image_processor(),
        tokenizer=tiny_tokenizer(),
        num_image_tokens=FEATURES_PER_TILE,
        vision_feature_select_strategy="full",
        chat_template=CHAT_TEMPLATE,
        vision_aspect_ratio=VISION_ASPECT_RATIO,
    )


def engine_processor(processor: Any) -> LlavaOnevisionProcessor:
    """The full ``LlavaOnevisionProcessor`` an inference engine (vLLM) loads with ``AutoProcessor``: the same
    tokenizer, template, image settings and token counts, plus the ``LlavaOnevisionVideoProcessor`` that class saves.
    Needs torchvision, as vLLM does; a clear error says so where it is missing. A processor that is already the full
    class, or not a LLaVA-OneVision one, is returned as it is."""
    if type(processor) is LlavaOnevisionProcessor or not isinstance(processor, LlavaOnevisionProcessor):
        return processor

    if not is_torchvision_available():
        raise ImportError(
            "saving a LlavaOnevisionProcessor for an inference engine needs torchvision (vLLM needs it too)"
        )

    image = processor.image_processor
    video = LlavaOnevisionVideoProcessor(image_mean=list(image.image_mean), image_std=list(image.image_std))
    full_image = LlavaOnevisionImageProcessorPil(**_image_settings(image))
    return LlavaOnevisionProcessor(
        image_processor=full_image,
        tokenizer=processor.tokenizer,
        video_processor=video,
        num_image_tokens=processor.num_image_tokens,
        vision_feature_select_strategy=processor.vision_feature_select_strategy,
        chat_template=processor.chat_template,
        vision_aspect_ratio=processor.vision_aspect_ratio,
    )


#: The image processor settings carried between the PIL classes (everything else is the class's).
SETTINGS = (
    "size",
    "image_grid_pinpoints",
    "image_mean",
    "image_std",
    "resample",
    "do_resize",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "do_convert_rgb",
    "do_pad",
)


def _image_settings(image_processor: Any) -> dict[str, Any]:
    out = {}
    for key in SETTINGS:
        value = getattr(image_processor, key, None)
        if value is not None:
            out[key] = dict(value) if key == "size" else value
    return out


def load_processor(directory: str | Path) -> LlavaOnevisionImageOnlyProcessor:
    """A checkpoint's processor (tokenizer, chat template, image settings, ``num_image_tokens``, strategy) without its
    video processor and with per-image anyres, from local files only. Refuses a directory naming another processor."""

    directory = Path(directory)
    named = processor_class_of(directory)
    if named not in (None, "LlavaOnevisionProcessor", LlavaOnevisionImageOnlyProcessor.__name__):
        raise ValueError(f"{directory}: its processor files name {named!r}, not LlavaOnevisionProcessor")
    image_file = directory / "preprocessor_config.json"
    if not image_file.is_file():
        raise ValueError(f"{directory}: no image processor settings (preprocessor_config.json)")
    image_config = json.loads(image_file.read_text(encoding="utf-8"))
    processor_file = directory / "processor_config.json"
    processor_config = json.loads(processor_file.read_text(encoding="utf-8")) if processor_file.is_file() else {}
    image_config = {**image_config, **processor_config.get("image_processor", {})}
    image_processor = PerImageAnyresImageProcessor(**{k: v for k, v in image_config.items() if k in SETTINGS})
    # as transformers picks it: processor_config.json, chat_template.json, .jinja
    template = chat_template_of(directory)
    return LlavaOnevisionImageOnlyProcessor(
        image_processor=image_processor,
        tokenizer=AutoTokenizer.from_pretrained(str(directory), local_files_only=True),
        num_image_tokens=processor_config.get("num_image_tokens"),
        vision_feature_select_strategy=processor_config.get("vision_feature_select_strategy"),
        vision_aspect_ratio=processor_config.get("vision_aspect_ratio", "anyres_max_9"),
        chat_template=template,
    )
