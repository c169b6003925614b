"""The Qwen3.5 MoE family for vlmreg.

Qwen3.5 mixture-of-experts: hybrid linear/full attention, fused routed experts plus a shared expert. Checkpoints store
unfused experts.{i}.{gate,up,down}_proj.
"""

from __future__ import annotations

from typing import Any

from vlmreg_qwen_common import (
    TINY_LINEAR_ATTENTION,
    TINY_MOE,
    TINY_SPECIAL_TOKEN_IDS,
    TINY_VISION,
    qwen_descriptor,
    tiny_text,
)
from vlmreg_qwen_common.descriptor import ATTENTION, LINEAR_ATTENTION, SHARED_EXPERT

from vlmreg import ThinkingMode, hookimpl

__version__ = "0.1.0"


def tiny_config() -> Any:
    """A tiny random-init Qwen3_5MoeConfig of the real architecture (a few hundred thousand parameters)."""
    # deferred: start-up cost (loads transformers)
    from transformers import Qwen3_5MoeConfig  # noqa: PLC0415

    return Qwen3_5MoeConfig(
        text_config=tiny_text(TINY_LINEAR_ATTENTION, TINY_MOE, {"shared_expert_intermediate_size": 32}),
        vision_config=dict(TINY_VISION),
        **TINY_SPECIAL_TOKEN_IDS,
    )


@hookimpl
def vlmreg_register_families(register):
    register(
        qwen_descriptor(
            name="qwen3_5_moe",
            model_types=("qwen3_5_moe",),
            tiny_config=tiny_config,
            language_lora=(*ATTENTION, *LINEAR_ATTENTION, *SHARED_EXPERT),
            connectors=("model.visual.merger",),
            linear_attention=True,
            experts=True,
            unfused_expert_checkpoints=True,
            thinking_modes=[
                ThinkingMode("on", {"enable_thinking": True}),
                ThinkingMode("off", {"enable_thinking": False}),
            ],
            default_thinking_mode="on",
            vision_processor_id="Qwen/Qwen3.5-397B-A17B",
            vision_processor_ids={},
            max_videos_per_message=4,
            host_vision_inputs=True,
            description=__doc__.split("\n\n", 1)[1].strip(),
        )
    )
