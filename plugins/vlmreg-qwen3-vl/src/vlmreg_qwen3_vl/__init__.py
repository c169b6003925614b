"""The Qwen3-VL (dense) family for vlmreg.

Qwen3-VL dense (2B to 32B): SigLIP-2 style vision tower with DeepStack mergers, Qwen3 text model, interleaved M-RoPE.
Instruct checkpoints answer directly, Thinking checkpoints always reason.
"""

from __future__ import annotations

from typing import Any

from vlmreg_qwen_common import TINY_SPECIAL_TOKEN_IDS, TINY_VISION, qwen_descriptor, tiny_text
from vlmreg_qwen_common.descriptor import ATTENTION, DENSE_MLP

from vlmreg import ThinkingMode, hookimpl

__version__ = "0.1.0"


def tiny_config() -> Any:
    """A tiny random-init Qwen3VLConfig of the real architecture (a few hundred thousand parameters)."""
    # deferred: start-up cost (loads transformers)
    from transformers import Qwen3VLConfig  # noqa: PLC0415

    return Qwen3VLConfig(
        text_config=tiny_text(),
        vision_config={**TINY_VISION, "deepstack_visual_indexes": [0]},
        **TINY_SPECIAL_TOKEN_IDS,
    )


def qwen3_vl_2b_config() -> Any:
    """The shape of Qwen3-VL-2B (random init), for GPU benchmarks: 28 layers of 2048, a 24-block vision tower.

    Special token ids are the tiny processor's, so a random 2B model runs with the bundled offline processor.
    """
    # deferred: start-up cost (loads transformers)
    from transformers import Qwen3VLConfig  # noqa: PLC0415

    return Qwen3VLConfig(
        text_config={
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 262144,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_heads": 16,
            "out_hidden_size": 2048,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "deepstack_visual_indexes": [5, 11, 17],
            "num_position_embeddings": 2304,
        },
        tie_word_embeddings=True,
        **TINY_SPECIAL_TOKEN_IDS,
    )


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
            thinking_modes=[
                ThinkingMode("off", checkpoints=("*", "!*-Thinking*")),
                ThinkingMode("on", checkpoints=("*-Thinking*",)),
            ],
            default_thinking_mode="off",
            vision_processor_id="Qwen/Qwen3-VL-2B-Instruct",
            vision_processor_ids={"*-Thinking*": "Qwen/Qwen3-VL-2B-Thinking"},
            shapes={"2b": qwen3_vl_2b_config},
            max_videos_per_message=4,
            host_vision_inputs=True,
            description=__doc__.split("\n\n", 1)[1].strip(),
        )
    )
