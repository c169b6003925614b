"""Qwen processors that work offline and without torchvision.

``Qwen3VLProcessor`` insists on a video processor, which needs torchvision. This subclass drops the
``video_processor`` argument (processors read their parts from the ``__init__`` signature) and uses the
PIL image processor. ``AutoProcessor`` without torchvision silently returns only a tokenizer, so
`load_processor` builds the processor explicitly and checks it has its image processor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.utils.hub import CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE, LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE

TINY_PROCESSOR_DIR = Path(__file__).with_name("tiny_processor")


class TinyQwenProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` with an image processor and a tokenizer, and no video processor."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs: Any):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=chat_template, **kwargs)


_WITHOUT_VIDEO: dict[type, type] = {}


def without_video(processor_class: type) -> type:
    """``processor_class`` (``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``, ...) taking an image processor and a
    tokenizer and no video processor, as `TinyQwenProcessor` does for Qwen3-VL: built once per class."""
    if processor_class not in _WITHOUT_VIDEO:

        def __init__(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None, **kwargs: Any) -> None:
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
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        raise ImportError("saving a Qwen3-VL processor for an inference engine needs torchvision (vLLM needs it too)")
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    image = processor.image_processor
    video = Qwen3VLVideoProcessor(
        patch_size=image.patch_size, temporal_patch_size=image.temporal_patch_size, merge_size=image.merge_size,
        image_mean=list(image.image_mean), image_std=list(image.image_std),
    )
    return Qwen3VLProcessor(
        image_processor=processor.image_processor, tokenizer=processor.tokenizer, video_processor=video,
        chat_template=processor.chat_template,
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def chat_template_of(directory: str | Path) -> str | dict[str, str] | None:
    """The processor's chat template in a directory, found as transformers 5's ``ProcessorMixin.from_pretrained``
    finds it: a ``"chat_template"`` in ``processor_config.json``, else ``chat_template.json`` (the legacy file real
    Qwen3-VL checkpoints ship; its ``"chat_template"`` key), else ``chat_template.jinja`` with any
    ``additional_chat_templates/*.jinja`` (a dict keyed by name, ``"default"`` for the main one). ``None``: the directory has
    none of these (`load_processor` then falls back to the tokenizer's template, from ``tokenizer_config.json``).
    """
    directory = Path(directory)
    config = directory / "processor_config.json"
    in_config = _read_json(config).get("chat_template") if config.is_file() else None
    if in_config is not None:
        return in_config
    extra_dir = directory / CHAT_TEMPLATE_DIR
    extra = {p.stem: p.read_text(encoding="utf-8") for p in sorted(extra_dir.glob("*.jinja"))} if extra_dir.is_dir() else {}
    legacy = directory / LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE
    if legacy.is_file():
        if extra:
            raise ValueError(f"{directory}: {legacy.name} and {CHAT_TEMPLATE_DIR}/ both hold templates; transformers refuses that too")
        data = _read_json(legacy)
        if not isinstance(data.get("chat_template"), str):
            raise ValueError(f"{legacy}: no \"chat_template\" string")
        return data["chat_template"]
    raw = directory / CHAT_TEMPLATE_FILE
    if raw.is_file():
        extra["default"] = raw.read_text(encoding="utf-8")
    if list(extra) == ["default"]:
        return extra["default"]
    return extra or None


def load_processor(directory: str | Path, processor_class: type | None = None) -> Any:
    """Load tokenizer, chat template and image-processor settings from a local directory (no network).

    The chat template is the one transformers' processor loading would pick (`chat_template_of`); a directory with
    none has the tokenizer's own (``chat_template.jinja``, else ``"chat_template"`` in ``tokenizer_config.json``).
    ``processor_class``: the class to build (a processor taking ``image_processor``, ``tokenizer`` and
    ``chat_template``, no video processor); `TinyQwenProcessor` when not given.
    """
    from transformers import AutoTokenizer

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


def full_qwen2_vl_processor(processor: Any, processor_class: type) -> Any:
    """``processor_class`` (``Qwen2VLProcessor`` or ``Qwen2_5_VLProcessor``) with a ``Qwen2VLVideoProcessor``, as an
    inference engine (vLLM) loads it: the same tokenizer, template and image settings. A processor that already is
    ``processor_class`` itself, or is not one of its subclasses, is returned as it is. Needs torchvision."""
    if type(processor) is processor_class or not isinstance(processor, processor_class):
        return processor
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        raise ImportError(f"saving a {processor_class.__name__} for an inference engine needs torchvision (vLLM needs it too)")
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    image = processor.image_processor
    video = Qwen2VLVideoProcessor(
        patch_size=image.patch_size, temporal_patch_size=image.temporal_patch_size, merge_size=image.merge_size,
        image_mean=list(image.image_mean), image_std=list(image.image_std),
    )
    return processor_class(
        image_processor=processor.image_processor, tokenizer=processor.tokenizer, video_processor=video,
        chat_template=processor.chat_template,
    )
