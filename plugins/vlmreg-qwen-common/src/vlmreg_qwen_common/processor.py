"""Qwen processors that work offline and without torchvision.

``Qwen3VLProcessor`` insists on a video processor, which needs torchvision. This subclass drops the
``video_processor`` argument (processors read their parts from the ``__init__`` signature) and uses the
PIL image processor. ``AutoProcessor`` without torchvision silently returns only a tokenizer, so
`load_processor` builds the processor explicitly and checks it has its image processor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.utils import is_torchvision_available

from vlmreg.sdk.processor_files import chat_template_of

TINY_PROCESSOR_DIR = Path(__file__).with_name("tiny_processor")


class TinyQwenProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` with an image processor and a tokenizer, and no video processor."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | dict[str, str] | None = None, **kwargs: Any):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=chat_template, **kwargs)


_WITHOUT_VIDEO: dict[type, type] = {}


def without_video(processor_class: type[Any]) -> type[Any]:
    """``processor_class`` (``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``, ...) taking an image processor and a
    tokenizer and no video processor, as `TinyQwenProcessor` does for Qwen3-VL: built once per class."""
    if processor_class not in _WITHOUT_VIDEO:

        def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: str | dict[str, str] | None = None, **kwargs: Any) -> None:
            processor_class.__init__(self, image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=chat_template, **kwargs)

        name = f"Tiny{processor_class.__name__}"
        _WITHOUT_VIDEO[processor_class] = type(name, (processor_class,), {
            "__init__": __init__, "__module__": __name__, "__qualname__": name,
            "__doc__": f"``{processor_class.__name__}`` with an image processor and a tokenizer, and no video processor.",
        })
    return _WITHOUT_VIDEO[processor_class]


def engine_processor(processor: Any) -> Qwen3VLProcessor:
    """The full ``Qwen3VLProcessor`` vLLM loads with ``AutoProcessor``: the same tokenizer, template and image settings,
    plus the ``Qwen3VLVideoProcessor`` that class requires (built with the image processor's patch, merge, temporal and
    normalisation settings). Needs torchvision, as vLLM itself does; a clear error says so where it is missing.
    """
    if type(processor) is Qwen3VLProcessor or not isinstance(processor, Qwen3VLProcessor):
        return processor

    if not is_torchvision_available():
        raise ImportError("saving a Qwen3-VL processor for an inference engine needs torchvision (vLLM needs it too)")

    image = processor.image_processor
    video = Qwen3VLVideoProcessor(
        patch_size=image.patch_size, temporal_patch_size=image.temporal_patch_size, merge_size=image.merge_size,
        image_mean=list(image.image_mean), image_std=list(image.image_std),
    )
    return Qwen3VLProcessor(
        image_processor=processor.image_processor, tokenizer=processor.tokenizer, video_processor=video,
        chat_template=processor.chat_template,
    )


def load_processor(directory: str | Path, processor_class: type[Any] | None = None) -> Any:
    """Load tokenizer, chat template and image-processor settings from a local directory (no network).

    The chat template is the one transformers' processor loading would pick (`chat_template_of`); a directory with
    none has the tokenizer's own (``chat_template.jinja``, else ``"chat_template"`` in ``tokenizer_config.json``).
    ``processor_class``: the class to build (a processor taking ``image_processor``, ``tokenizer`` and
    ``chat_template``, no video processor); `TinyQwenProcessor` when not given.
    """

    directory = Path(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(directory, local_files_only=True)
    chat_template = chat_template_of(directory)
    if chat_template is None:
        chat_template = tokenizer.chat_template
    cls = processor_class or TinyQwenProcessor
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def tiny_processor() -> TinyQwenProcessor:
    """The processor of the bundled tiny Qwen models: 1024-token BPE, patch 16, merge 2."""
    return load_processor(TINY_PROCESSOR_DIR)


def full_qwen2_vl_processor(processor: Any, processor_class: type[Any]) -> Any:
    """``processor_class`` (``Qwen2VLProcessor`` or ``Qwen2_5_VLProcessor``) with a ``Qwen2VLVideoProcessor``, as an
    inference engine (vLLM) loads it: the same tokenizer, template and image settings. A processor that already is
    ``processor_class`` itself, or is not one of its subclasses, is returned as it is. Needs torchvision."""
    if type(processor) is processor_class or not isinstance(processor, processor_class):
        return processor

    if not is_torchvision_available():
        raise ImportError(f"saving a {processor_class.__name__} for an inference engine needs torchvision (vLLM needs it too)")
    # deferred: needs torchvision, which the callers check for first
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor  # noqa: PLC0415

    image = processor.image_processor
    video = Qwen2VLVideoProcessor(
        patch_size=image.patch_size, temporal_patch_size=image.temporal_patch_size, merge_size=image.merge_size,
        image_mean=list(image.image_mean), image_std=list(image.image_std),
    )
    return processor_class(
        image_processor=processor.image_processor, tokenizer=processor.tokenizer, video_processor=video,
        chat_template=processor.chat_template,
    )
