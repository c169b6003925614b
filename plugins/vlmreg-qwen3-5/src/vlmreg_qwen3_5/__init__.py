"""The Qwen3.5 (dense) family for vlmreg.

Qwen3.5 dense: natively multimodal, hybrid Gated DeltaNet (linear attention) and full-attention layers. One checkpoint
thinks or not by the chat template's enable_thinking.
"""

from __future__ import annotations

from typing import Any

from vlmreg_qwen_common import TINY_LINEAR_ATTENTION, TINY_SPECIAL_TOKEN_IDS, TINY_VISION, qwen_descriptor, tiny_text
from vlmreg_qwen_common.descriptor import ATTENTION, DENSE_MLP, LINEAR_ATTENTION

from vlmreg import ThinkingMode, hookimpl

__version__ = "0.1.0"


def tiny_config() -> Any:
    """A tiny random-init Qwen3_5Config of the real architecture (a few hundred thousand parameters)."""
    # deferred: start-up cost (loads transformers)
    from transformers import Qwen3_5Config  # noqa: PLC0415

    return Qwen3_5Config(
        text_config=tiny_text(TINY_LINEAR_ATTENTION), vision_config=dict(TINY_VISION), **TINY_SPECIAL_TOKEN_IDS
    )


@hookimpl
def vlmreg_register_families(register):
    register(
        qwen_descriptor(
            name="qwen3_5",
            model_types=("qwen3_5",),
            tiny_config=tiny_config,
            language_lora=(*ATTENTION, *LINEAR_ATTENTION, *DENSE_MLP),
            connectors=("model.visual.merger",),
            linear_attention=True,
            experts=False,
            thinking_modes=[
                ThinkingMode("on", {"enable_thinking": True}),
                ThinkingMode("off", {"enable_thinking": False}),
            ],
            default_thinking_mode="on",
            vision_processor_id="Qwen/Qwen3.5-27B",
            vision_processor_ids={},
            max_videos_per_message=4,
            host_vision_inputs=True,
            description=__doc__.split("\n\n", 1)[1].strip(),
        )
    )
