"""GLM-4.1V processors offline and without torchvision: the tiny one, a checkpoint's, and the engine's.

``Glm4vProcessor`` takes a video processor, which needs torchvision (missing here). `ImageOnlyGlm4vProcessor`
is the same class without it: processors read their parts from the ``__init__`` signature, so dropping the
argument drops the part, and everything vlmreg uses (the chat template, the ``<|image|>`` expansion,
``mm_token_type_ids``) is the real class's own code. Images go through transformers' PIL image processor
(``Glm4vImageProcessorPil``). ``AutoProcessor`` without torchvision silently returns only a tokenizer, so
`load_processor` builds the processor explicitly.

The tiny processor is loaded from the asset in ``tiny_processor/`` (written once by
``scripts/build_tiny_processor.py``, never at import time), exactly as a checkpoint's processor is loaded:

- a word-level tokenizer with GLM-4.1V's control tokens (``[gMASK] <sop> <|system|> <|user|> <|assistant|>
  <|observation|> <|begin_of_image|> <|image|> <|end_of_image|>`` and the video ones) as special added tokens, and
  ``<think> </think> <answer> </answer> <|begin_of_box|> <|end_of_box|>`` as added tokens that decoding keeps (a
  reward must see the reasoning markers it strips); a run of newlines is one token; words are split at whitespace
  and punctuation and spaces are not kept, so decoding puts a space between words;
- a chat template that renders what GLM-4.1V-9B-Thinking's does (``[gMASK]<sop>``, ``<|user|>\\n``, an image as
  ``<|begin_of_image|><|image|><|end_of_image|>``, ``<|assistant|>\\n``; an assistant turn is closed by the next
  role token, which the model samples: ``<|user|>``), written here;
- the PIL image processor with GLM's patch 14, merge 2 and temporal patch 2, CLIP mean/std, and a pixel budget of
  28x28 to 112x112: a 64x64 image becomes 56x56, 4x4 patches, 4 ``<|image|>`` tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.glm4v.processing_glm4v import Glm4vProcessor
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
from transformers.utils import is_torchvision_available

from vlmreg.sdk.processor_files import chat_template_of

TINY_PROCESSOR_DIR = Path(__file__).with_name("tiny_processor")


class ImageOnlyGlm4vProcessor(Glm4vProcessor):
    """``Glm4vProcessor`` with an image processor and a tokenizer, and no video processor."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: str | dict[str, str] | None = None,
        **kwargs: Any,
    ):
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )


def load_processor(directory: str | Path) -> ImageOnlyGlm4vProcessor:
    """A checkpoint's (or the tiny asset's) processor from a local directory, no network, no torchvision: its tokenizer,
    its image-processor settings (``preprocessor_config.json`` or ``processor_config.json``) and its chat template."""

    directory = Path(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    image_processor = Glm4vImageProcessorPil.from_pretrained(directory, local_files_only=True)
    template = chat_template_of(directory) or tokenizer.chat_template
    return ImageOnlyGlm4vProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


def tiny_processor() -> ImageOnlyGlm4vProcessor:
    """The processor of the tiny GLM-4.1V model (word-level vocabulary, patch 14, merge 2)."""
    return load_processor(TINY_PROCESSOR_DIR)


def engine_processor(processor: Any) -> Any:
    """The full ``Glm4vProcessor`` (with its ``Glm4vVideoProcessor``) that vLLM loads with ``AutoProcessor``: the same
    tokenizer, template and image settings. Needs torchvision, as vLLM does; a clear error says so where it is
    missing."""
    if type(processor) is Glm4vProcessor or not isinstance(processor, Glm4vProcessor):
        return processor

    if not is_torchvision_available():
        raise ImportError("saving a Glm4vProcessor for an inference engine needs torchvision (vLLM needs it too)")

    image = processor.image_processor
    video = Glm4vVideoProcessor(
        patch_size=image.patch_size,
        temporal_patch_size=image.temporal_patch_size,
        merge_size=image.merge_size,
        image_mean=list(image.image_mean),
        image_std=list(image.image_std),
    )
    return Glm4vProcessor(
        image_processor=image,
        tokenizer=processor.tokenizer,
        video_processor=video,
        chat_template=processor.chat_template,
    )
