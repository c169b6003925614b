"""The Qwen3-VL MoE family for vlmreg.

Qwen3-VL mixture-of-experts (30B-A3B, 235B-A22B): the Qwen3-VL vision tower and a Qwen3 MoE text model whose routed
experts are fused 3-D parameters.
"""

from __future__ import annotations

from typing import Any

from vlmreg_qwen_common import TINY_MOE, TINY_SPECIAL_TOKEN_IDS, TINY_VISION, qwen_descriptor, tiny_text
from vlmreg_qwen_common.descriptor import ATTENTION

from vlmreg import ThinkingMode, hookimpl

__version__ = "0.1.0"


#: transformers' Qwen3-VL MoE always renormalises the top-k routing weights; vLLM reads that from the config.
ROUTING = {"norm_topk_prob": True}


def tiny_config() -> Any:
    """A tiny random-init Qwen3VLMoeConfig of the real architecture (a few hundred thousand parameters).

    The experts are not square (2 x 48 != 64): transformers only transposes them on load when the shapes tell
    the two layouts apart, so a square tiny shape would hide a layout mistake.
    """
    # deferred: start-up cost (loads transformers)
    from transformers import Qwen3VLMoeConfig  # noqa: PLC0415

    return Qwen3VLMoeConfig(
        text_config=tiny_text(TINY_MOE, {"moe_intermediate_size": 48}, ROUTING),
        vision_config={**TINY_VISION, "deepstack_visual_indexes": [0]},
        **TINY_SPECIAL_TOKEN_IDS,
    )


def small_config() -> Any:
    """A GPU-sized random-init shape (about 0.25B parameters) with dimensions inference kernels accept (head_dim 128,
    16 experts of a non-square 384 x 1024), for checking engines such as vLLM without a download."""
    # deferred: start-up cost (loads transformers)
    from transformers import Qwen3VLMoeConfig  # noqa: PLC0415

    text = tiny_text(
        TINY_MOE,
        {
            "hidden_size": 1024,
            "intermediate_size": 2048,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "moe_intermediate_size": 384,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        },
        ROUTING,
    )
    vision = {
        **TINY_VISION,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_heads": 4,
        "out_hidden_size": 1024,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [0],
    }
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **TINY_SPECIAL_TOKEN_IDS)


def qwen3_vl_30b_a3b_config() -> Any:
    """The shape of Qwen3-VL-30B-A3B-Instruct (random init), for GPU benchmarks: 48 MoE layers of 2048 (128 experts
    of 768, 8 per token), a 27-block vision tower of 1152; about 31.1B parameters, 3.6B active per token (the
    published "30B-A3B" counts 30.5B / 3.3B, the language model only; see the tests).

    Values from the published ``Qwen/Qwen3-VL-30B-A3B-Instruct/config.json``, as transcribed at its commit 1fc78ad
    in a public repository's parser test (a Rust port of Qwen3-VL-MoE, ``hf_30b_a3b_json``), and the same values in
    another public copy (Omega17-VL's test config, with ``router_aux_loss_coef`` 0.001). Special token ids are the
    tiny processor's, so the random model runs with the bundled offline processor.
    """
    # deferred: start-up cost (loads transformers)
    from transformers import Qwen3VLMoeConfig  # noqa: PLC0415

    return Qwen3VLMoeConfig(
        text_config={
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
            **ROUTING,
        },
        vision_config={
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "out_hidden_size": 2048,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "hidden_act": "gelu_pytorch_tanh",
            "deepstack_visual_indexes": [8, 16, 24],
            "num_position_embeddings": 2304,
        },
        tie_word_embeddings=False,
        **TINY_SPECIAL_TOKEN_IDS,
    )


@hookimpl
def vlmreg_register_families(register):
    register(
        qwen_descriptor(
            name="qwen3_vl_moe",
            model_types=("qwen3_vl_moe",),
            tiny_config=tiny_config,
            shapes={"small": small_config, "30b-a3b": qwen3_vl_30b_a3b_config},
            language_lora=ATTENTION,
            connectors=("model.visual.merger", "model.visual.deepstack_merger_list"),
            experts=True,
            transposed_expert_checkpoints=True,
            thinking_modes=[
                ThinkingMode("off", checkpoints=("*", "!*-Thinking*")),
                ThinkingMode("on", checkpoints=("*-Thinking*",)),
            ],
            default_thinking_mode="off",
            vision_processor_id="Qwen/Qwen3-VL-30B-A3B-Instruct",
            vision_processor_ids={"*-Thinking*": "Qwen/Qwen3-VL-30B-A3B-Thinking"},
            max_videos_per_message=4,
            host_vision_inputs=True,
            description=__doc__.split("\n\n", 1)[1].strip(),
        )
    )
