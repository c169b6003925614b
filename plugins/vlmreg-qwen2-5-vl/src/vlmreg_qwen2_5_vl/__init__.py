"""The Qwen2.5-VL family for vlmreg.

Qwen2.5-VL (3B to 72B): ViT with window attention (full attention in a few blocks) and an MLP patch merger, Qwen2.5 text
model, M-RoPE in contiguous sections (not interleaved). No thinking mode. Checkpoints keep the legacy visual.* /
model.layers.* names, and the weight broadcast sends those.
"""

from __future__ import annotations

from typing import Any

from vlmreg_qwen_common import TINY_SPECIAL_TOKEN_IDS, TINY_VISION, qwen2_processors, qwen_descriptor, tiny_text
from vlmreg_qwen_common.descriptor import ATTENTION, DENSE_MLP

from vlmreg import hookimpl

__version__ = "0.1.0"

#: M-RoPE of Qwen2-VL / Qwen2.5-VL: contiguous (temporal, height, width) sections, summing to head_dim / 2.
TINY_ROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}
#: Window attention: 64-pixel windows (2 x 2 merged patches at patch 16), full attention in the last block.
TINY_WINDOWS = {"window_size": 64, "fullatt_block_indexes": [1]}
_TEXT_SHAPES = {
    "3b": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "7b": {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    },
}


def tiny_config() -> Any:
    """A tiny random-init Qwen2_5_VLConfig of the real architecture (about 300k parameters)."""
    # deferred: start-up cost (loads transformers)
    from transformers import Qwen2_5_VLConfig  # noqa: PLC0415

    text = tiny_text({"rope_parameters": dict(TINY_ROPE), "bos_token_id": 0})
    vision = {k: v for k, v in TINY_VISION.items() if k != "num_position_embeddings"} | TINY_WINDOWS
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **TINY_SPECIAL_TOKEN_IDS)


def _published_shape(size: str) -> Any:
    """A random-init config of a published Qwen2.5-VL size; special token ids are the tiny processor's."""
    # deferred: start-up cost (loads transformers)
    from transformers import Qwen2_5_VLConfig  # noqa: PLC0415

    text: dict[str, Any] = dict(_TEXT_SHAPES[size])
    tie = text.pop("tie_word_embeddings")
    text |= {
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    }
    vision = {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "out_hidden_size": text["hidden_size"],
    }
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, **TINY_SPECIAL_TOKEN_IDS)


def qwen2_5_vl_3b_config() -> Any:
    """The shape of Qwen2.5-VL-3B (random init): 36 layers of 2048, tied embeddings, a 32-block vision tower."""
    return _published_shape("3b")


def qwen2_5_vl_7b_config() -> Any:
    """The shape of Qwen2.5-VL-7B (random init): 28 layers of 3584, a 32-block vision tower."""
    return _published_shape("7b")


#: tiny, load and engine processors: transformers' ``Qwen2_5_VLProcessor`` (its video processor torch-only offline)
PROCESSORS = qwen2_processors("transformers.models.qwen2_5_vl.processing_qwen2_5_vl", "Qwen2_5_VLProcessor")


@hookimpl
def vlmreg_register_families(register):
    register(
        qwen_descriptor(
            name="qwen2_5_vl",
            model_types=("qwen2_5_vl",),
            tiny_config=tiny_config,
            language_lora=(*ATTENTION, *DENSE_MLP),
            connectors=("model.visual.merger",),
            projector=("merger.mlp.0", "merger.mlp.2"),
            experts=False,
            thinking_modes=[],
            default_thinking_mode=None,
            thinking_end=None,
            vision_processor_id="Qwen/Qwen2.5-VL-7B-Instruct",
            vision_processor_ids={
                "*Qwen2.5-VL-3B*": "Qwen/Qwen2.5-VL-3B-Instruct",
                "*Qwen2.5-VL-32B*": "Qwen/Qwen2.5-VL-32B-Instruct",
                "*Qwen2.5-VL-72B*": "Qwen/Qwen2.5-VL-72B-Instruct",
            },
            shapes={"3b": qwen2_5_vl_3b_config, "7b": qwen2_5_vl_7b_config},
            legacy_checkpoint_names=True,
            processors=PROCESSORS,
            max_videos_per_message=4,
            vllm_video_wrapper=None,  # vLLM's Qwen2-VL prompt update replaces the video pad alone, as the processor
            description=__doc__.split("\n\n", 1)[1].strip(),
        )
    )
