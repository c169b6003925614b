"""What the Qwen VLM families share: module paths, LoRA presets, tiny shapes and the offline processor.

The bundled family plugins (qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe, qwen2_5_vl, qwen2_vl) build their descriptors
with `qwen_descriptor`. Importing this package does not import torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

from vlmreg_qwen_common.descriptor import qwen_descriptor
from vlmreg_qwen_common.tiny import (
    TINY_LINEAR_ATTENTION,
    TINY_MOE,
    TINY_SPECIAL_TOKEN_IDS,
    TINY_TEXT,
    TINY_VISION,
    tiny_text,
)

__all__ = [
    "TINY_LINEAR_ATTENTION",
    "TINY_MOE",
    "TINY_SPECIAL_TOKEN_IDS",
    "TINY_TEXT",
    "TINY_VISION",
    "engine_processor",
    "load_processor",
    "mrope_position_ids",
    "qwen2_processors",
    "prepare_deepstack",
    "prepare_linear_attention",
    "prepare_moe",
    "prepare_moe_linear_attention",
    "prepare_vision",
    "qwen_descriptor",
    "segment_linear_attention",
    "tiny_processor",
    "tiny_text",
]


def tiny_processor() -> Any:
    """The offline processor of the tiny Qwen models (imports transformers on call)."""
    # deferred: start-up cost (loads transformers)
    from vlmreg_qwen_common.processor import tiny_processor as build  # noqa: PLC0415

    return build()


def mrope_position_ids(model: Any, inputs: Any) -> Any:
    """3-D M-RoPE positions for training (imports torch on call)."""
    # deferred: start-up cost (loads torch)
    from vlmreg_qwen_common.positions import mrope_position_ids as positions  # noqa: PLC0415

    return positions(model, inputs)


def segment_linear_attention(model: Any) -> None:
    """Make Gated DeltaNet layers respect packed-sequence boundaries (imports torch on call)."""
    # deferred: start-up cost (loads torch)
    from vlmreg_qwen_common.positions import segment_linear_attention as segment  # noqa: PLC0415

    segment(model)


def prepare_vision(model: Any) -> None:
    """The vision patch embedding run as a matmul with its own weight (`vlmreg_qwen_common.patch_embed`; imports
    torch on call): every Qwen family's preparation starts with it."""
    # deferred: start-up cost (loads torch)
    from vlmreg_qwen_common.patch_embed import patch_embed_as_matmul  # noqa: PLC0415

    patch_embed_as_matmul(model)


def prepare_deepstack(model: Any) -> None:
    """`prepare_vision`, and DeepStack's features added without the host waiting for the GPU
    (`vlmreg_qwen_common.deepstack`; imports torch on call); a model without DeepStack gets `prepare_vision` only."""
    # deferred: start-up cost (loads torch)
    from vlmreg_qwen_common.deepstack import add_deepstack_without_waiting  # noqa: PLC0415

    prepare_vision(model)
    add_deepstack_without_waiting(model)


def prepare_linear_attention(model: Any) -> None:
    """`prepare_vision` and `segment_linear_attention`: Qwen3.5's preparation."""
    prepare_vision(model)
    segment_linear_attention(model)


def prepare_moe(model: Any) -> None:
    """Routed experts in two grouped GEMMs per layer (`vlmreg_qwen_common.grouped_experts`; imports torch on call),
    and `prepare_deepstack`."""
    # deferred: start-up cost (loads torch)
    from vlmreg_qwen_common.grouped_experts import grouped_mm_available, use_grouped_experts  # noqa: PLC0415

    if grouped_mm_available():
        use_grouped_experts(model)
    prepare_deepstack(model)


def prepare_moe_linear_attention(model: Any) -> None:
    """`segment_linear_attention`, then `prepare_moe`: Qwen3.5-MoE's preparation."""
    segment_linear_attention(model)
    prepare_moe(model)


def engine_processor(processor: Any) -> Any:
    """The full Qwen3-VL processor an inference engine (vLLM) loads, video processor included (imports on call)."""
    # deferred: start-up cost (loads transformers)
    from vlmreg_qwen_common.processor import engine_processor as build  # noqa: PLC0415

    return build(processor)


def load_processor(directory: Any, processor_class: type | None = None) -> Any:
    """A Qwen processor from a local checkpoint directory, without torchvision (imports transformers on call);
    ``processor_class``: the processor class to build (default: the Qwen3-VL one)."""
    # deferred: start-up cost (loads transformers)
    from vlmreg_qwen_common.processor import load_processor as load  # noqa: PLC0415

    return load(directory, processor_class)


def qwen2_processors(module: str, class_name: str) -> tuple[Any, Any, Any]:
    """The (tiny, load, engine) processor callables of a family whose processor is transformers' ``module.class_name``
    (``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``): offline and without torchvision for tiny and load (the class with
    transformers' ``Qwen2VLVideoProcessor`` resizing and normalising in plain torch), the full class with that video
    processor itself for an inference engine. Transformers is imported when one is called."""

    def processor_class() -> type:
        return getattr(importlib.import_module(module), class_name)

    def tiny_processor() -> Any:
        # deferred: start-up cost (loads transformers)
        from vlmreg_qwen_common.processor import (  # noqa: PLC0415
            TINY_PROCESSOR_DIR,
            load_processor,
            with_torch_only_video,
        )

        return load_processor(TINY_PROCESSOR_DIR, with_torch_only_video(processor_class()))

    def load_processor(directory: Any) -> Any:
        # deferred: start-up cost (loads transformers)
        from vlmreg_qwen_common.processor import load_processor as load  # noqa: PLC0415
        from vlmreg_qwen_common.processor import with_torch_only_video  # noqa: PLC0415

        return load(directory, with_torch_only_video(processor_class()))

    def engine_processor(processor: Any) -> Any:
        # deferred: start-up cost (loads transformers)
        from vlmreg_qwen_common.processor import full_qwen2_vl_processor  # noqa: PLC0415

        return full_qwen2_vl_processor(processor, processor_class())

    return tiny_processor, load_processor, engine_processor
