"""The Qwen3-VL (dense) family for vlmreg.

Qwen3-VL dense (2B to 32B): SigLIP-2 style vision tower with DeepStack mergers, Qwen3 text model, interleaved M-RoPE. Instruct checkpoints answer directly, Thinking checkpoints always reason.
"""

from __future__ import annotations

from typing import Any

from vlmreg import ThinkingMode, hookimpl
from vlmreg_qwen_common import TINY_SPECIAL_TOKEN_IDS, TINY_VISION, qwen_descriptor, tiny_text
from vlmreg_qwen_common.descriptor import ATTENTION, DENSE_MLP

__version__ = "0.1.0"


def tiny_config() -> Any:
    """A tiny random-init Qwen3VLConfig of the real architecture (a few hundred thousand parameters)."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(text_config=tiny_text(), vision_config={**TINY_VISION, "deepstack_visual_indexes": [0]}, **TINY_SPECIAL_TOKEN_IDS)


@hookimpl
def vlmreg_register_families(register):
    register(
        qwen_descriptor(
            name="qwen3_vl",
            model_types=("qwen3_vl",),
            tiny_config=tiny_config,
            language_lora=(*ATTENTION, *DENSE_MLP),
            connectors=("model.visual.merger", "model.visual.deepstack_merger_list"),
            experts=False,
            thinking_modes=[ThinkingMode("off", checkpoints=("*", "!*-Thinking*")), ThinkingMode("on", checkpoints=("*-Thinking*",))],
            default_thinking_mode="off",
            vision_processor_id="Qwen/Qwen3-VL-2B-Instruct",
            vision_processor_ids={"*-Thinking*": "Qwen/Qwen3-VL-2B-Thinking"},
            description=__doc__.split("\n\n", 1)[1].strip(),
        )
    )
