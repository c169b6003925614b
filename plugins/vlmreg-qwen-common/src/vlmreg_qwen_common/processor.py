"""Qwen processors that work offline and without torchvision.

``Qwen3VLProcessor`` insists on a video processor, and transformers' video processors need torchvision.
`TinyQwenProcessor` takes the PIL image processor and the Qwen3-VL video processor made torch-only
(`vlmreg_qwen_common.video.torch_only`: its resize and normalisation in plain torch; everything else, timestamps
included, is transformers' own). ``AutoProcessor`` without torchvision silently returns only a tokenizer, so
`load_processor` builds the processor explicitly. The Qwen2 processors (``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``:
`with_torch_only_video`) get transformers' ``Qwen2VLVideoProcessor`` made torch-only the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.utils import is_torchvision_available

from vlmreg.sdk.processor_files import chat_template_of
from vlmreg_qwen_common.video import qwen2_vl_video_processor_class, torch_only

TINY_PROCESSOR_DIR = Path(__file__).with_name("tiny_processor")


class TinyQwenProcessor(Qwen3VLProcessor):
    """``Qwen3VLProcessor`` with the PIL image processor and a torch-only Qwen3-VL video processor (built from the
    image processor's settings when none is given)."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        video_processor: Any = None,
        chat_template: str | dict[str, str] | None = None,
        **kwargs: Any,
    ):
        if video_processor is None and image_processor is not None:
            video_processor = qwen3_vl_video_processor(image_processor)
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=video_processor,
            chat_template=chat_template,
            **kwargs,
        )

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        # transformers looks the video processor's base class up by name, which without torchvision it cannot import
        if argument_name == "video_processor" and isinstance(argument, Qwen3VLVideoProcessor):
            return type(argument)
        return super().check_argument_for_proper_class(argument_name, argument)


def _video_settings(image: Any) -> dict[str, Any]:
    return {
        "patch_size": image.patch_size,
        "temporal_patch_size": image.temporal_patch_size,
        "merge_size": image.merge_size,
        "image_mean": list(image.image_mean),
        "image_std": list(image.image_std),
    }


def qwen3_vl_video_processor(image_processor: Any, directory: str | Path | None = None) -> Any:
    """A torch-only ``Qwen3VLVideoProcessor``: from ``directory``'s ``video_preprocessor_config.json`` when it has one,
    else with the image processor's patch, merge, temporal, normalisation and size settings (the tiny processor).
    ``cap_pixels_per_frame`` is set (as transformers will default to from 5.22), so no warning is logged."""
    cls = torch_only(Qwen3VLVideoProcessor)
    if directory is not None and (Path(directory) / "video_preprocessor_config.json").is_file():
        return cls.from_pretrained(directory, local_files_only=True)
    size = dict(image_processor.size) if getattr(image_processor, "size", None) else None
    return cls(**_video_settings(image_processor), **({"size": size} if size else {}), cap_pixels_per_frame=False)


def qwen2_vl_video_processor(image_processor: Any, directory: str | Path | None = None) -> Any:
    """A torch-only ``Qwen2VLVideoProcessor``: from ``directory`` as transformers loads one (its
    ``processor_config.json``'s ``video_processor``, else ``video_preprocessor_config.json``, else the image
    processor's ``preprocessor_config.json``) when it has any of them, else with the image processor's patch, merge,
    temporal, normalisation and size settings (the tiny processor, ``cap_pixels_per_frame`` off as for Qwen3-VL)."""
    cls = torch_only(qwen2_vl_video_processor_class())
    if directory is not None:
        directory = Path(directory)
        nested = directory / "processor_config.json"
        if (
            (directory / "video_preprocessor_config.json").is_file()
            or (directory / "preprocessor_config.json").is_file()
            or (nested.is_file() and "video_processor" in json.loads(nested.read_text()))
        ):
            return cls.from_pretrained(directory, local_files_only=True)
    size = dict(image_processor.size) if getattr(image_processor, "size", None) else None
    return cls(**_video_settings(image_processor), **({"size": size} if size else {}), cap_pixels_per_frame=False)


_WITH_VIDEO: dict[type, type] = {}


def with_torch_only_video(processor_class: type[Any]) -> type[Any]:
    """``processor_class`` (``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``) taking a torch-only
    ``Qwen2VLVideoProcessor`` (`qwen2_vl_video_processor`, built from the image processor when none is given), as
    `TinyQwenProcessor` does for Qwen3-VL; every method that encodes text, images and videos is the class's own.
    Built once per class."""
    if processor_class not in _WITH_VIDEO:
        video_class = qwen2_vl_video_processor_class()

        def __init__(
            self: Any,
            image_processor: Any = None,
            tokenizer: Any = None,
            video_processor: Any = None,
            chat_template: str | dict[str, str] | None = None,
            **kwargs: Any,
        ) -> None:
            if video_processor is None and image_processor is not None:
                video_processor = qwen2_vl_video_processor(image_processor)
            processor_class.__init__(
                self,
                image_processor=image_processor,
                tokenizer=tokenizer,
                video_processor=video_processor,
                chat_template=chat_template,
                **kwargs,
            )

        def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
            # transformers looks the video processor's base class up by name, which without torchvision it cannot
            # import (as in TinyQwenProcessor)
            if argument_name == "video_processor" and isinstance(argument, video_class):
                return type(argument)
            return processor_class.check_argument_for_proper_class(self, argument_name, argument)

        name = f"Tiny{processor_class.__name__}"
        _WITH_VIDEO[processor_class] = type(
            name,
            (processor_class,),
            {
                "__init__": __init__,
                "check_argument_for_proper_class": check_argument_for_proper_class,
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"``{processor_class.__name__}`` with the PIL image processor and a torch-only "
                "``Qwen2VLVideoProcessor``.",
            },
        )
    return _WITH_VIDEO[processor_class]


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
    ours = getattr(processor, "video_processor", None)
    settings = {**_video_settings(image), "size": dict(ours.size)} if ours is not None else _video_settings(image)
    video = Qwen3VLVideoProcessor(**settings)
    return Qwen3VLProcessor(
        image_processor=processor.image_processor,
        tokenizer=processor.tokenizer,
        video_processor=video,
        chat_template=processor.chat_template,
    )


def load_processor(directory: str | Path, processor_class: type[Any] | None = None) -> Any:
    """Load tokenizer, chat template and image-processor settings from a local directory (no network).

    The chat template is the one transformers' processor loading would pick (`chat_template_of`); a directory with
    none has the tokenizer's own (``chat_template.jinja``, else ``"chat_template"`` in ``tokenizer_config.json``).
    ``processor_class``: a Qwen2 processor class made torch-only by `with_torch_only_video` (its video processor from
    `qwen2_vl_video_processor`); `TinyQwenProcessor` (a Qwen3-VL video processor) when not given.
    """

    directory = Path(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(directory, local_files_only=True)
    chat_template = chat_template_of(directory)
    if chat_template is None:
        chat_template = tokenizer.chat_template
    if processor_class is None:
        video = qwen3_vl_video_processor(image_processor, directory)
        return TinyQwenProcessor(
            image_processor=image_processor, tokenizer=tokenizer, video_processor=video, chat_template=chat_template
        )
    video = qwen2_vl_video_processor(image_processor, directory)
    return processor_class(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=video, chat_template=chat_template
    )


def tiny_processor() -> TinyQwenProcessor:
    """The processor of the bundled tiny Qwen models: 1024-token BPE, patch 16, merge 2."""
    return load_processor(TINY_PROCESSOR_DIR)


def full_qwen2_vl_processor(processor: Any, processor_class: type[Any]) -> Any:
    """``processor_class`` (``Qwen2VLProcessor`` or ``Qwen2_5_VLProcessor``) with transformers' own
    ``Qwen2VLVideoProcessor``, as an inference engine (vLLM) loads it: the same tokenizer, template, image settings and
    video settings (the trainer's video processor's, size included, so the engine sizes videos as the trainer does). A
    processor that already is ``processor_class`` itself, or is not one of its subclasses, is returned as it is.
    Needs torchvision."""
    if type(processor) is processor_class or not isinstance(processor, processor_class):
        return processor

    if not is_torchvision_available():
        raise ImportError(
            f"saving a {processor_class.__name__} for an inference engine needs torchvision (vLLM needs it too)"
        )
    # deferred: needs torchvision, which the callers check for first
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor  # noqa: PLC0415

    image = processor.image_processor
    ours = getattr(processor, "video_processor", None)
    settings = _video_settings(ours if ours is not None else image)
    if ours is not None and getattr(ours, "size", None):
        settings["size"] = dict(ours.size)
    video = Qwen2VLVideoProcessor(**settings)
    return processor_class(
        image_processor=processor.image_processor,
        tokenizer=processor.tokenizer,
        video_processor=video,
        chat_template=processor.chat_template,
    )
