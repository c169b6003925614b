"""Tiny shapes of the Qwen VLM architectures (a few hundred thousand parameters, built in ~0.02 s).

The special token ids match the bundled tiny processor's tokenizer (see scripts/build_tiny_tokenizer.py).
"""

from __future__ import annotations

from typing import Any

TINY_SPECIAL_TOKEN_IDS = {
    "vision_start_token_id": 3,
    "vision_end_token_id": 4,
    "image_token_id": 5,
    "video_token_id": 6,
}

TINY_TEXT: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e4,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    },
}

TINY_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 64,
}

#: Qwen3.5's hybrid layers: one Gated DeltaNet (linear attention) layer, then one full attention layer.
TINY_LINEAR_ATTENTION: dict[str, Any] = {
    "layer_types": ["linear_attention", "full_attention"],
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e4,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.25,
    },
}

TINY_MOE: dict[str, Any] = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}


def tiny_text(*extras: dict[str, Any]) -> dict[str, Any]:
    """The tiny text config with architecture-specific extras merged in (later ones win)."""
    merged = dict(TINY_TEXT)
    for extra in extras:
        merged.update(extra)
    return merged
