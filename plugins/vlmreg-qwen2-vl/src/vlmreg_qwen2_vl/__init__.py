"""The Qwen2-VL family for vlmreg.

Qwen2-VL (2B, 7B, 72B): ViT with full attention (LayerNorm, GELU MLP) and an MLP patch merger, Qwen2 text model, M-RoPE
in contiguous sections (not interleaved). No thinking mode. Checkpoints keep the legacy visual.* / model.layers.* names,
and the weight broadcast sends those.
"""

from __future__ import annotations

from typing import Any

from vlmreg_qwen_common import TINY_SPECIAL_TOKEN_IDS, qwen2_processors, qwen_descriptor, tiny_text
from vlmreg_qwen_common.descriptor import ATTENTION, DENSE_MLP

from vlmreg import hookimpl

__version__ = "0.1.0"

#: M-RoPE of Qwen2-VL: contiguous (temporal, height, width) sections, summing to head_dim / 2.
TINY_ROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}
#: Qwen2-VL's vision config names its width ``embed_dim``; its ``hidden_size`` is the merger's output (the text width).
TINY_VISION = {
    "depth": 2,
    "embed_dim": 32,
    "hidden_size": 64,
    "mlp_ratio": 2,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def tiny_config() -> Any:
    """A tiny random-init Qwen2VLConfig of the real architecture (about 300k parameters)."""
    # deferred: start-up cost (loads transformers)
    from transformers import Qwen2VLConfig  # noqa: PLC0415

    text = tiny_text({"rope_parameters": dict(TINY_ROPE), "bos_token_id": 0})
    return Qwen2VLConfig(text_config=text, vision_config=dict(TINY_VISION), **TINY_SPECIAL_TOKEN_IDS)


#: tiny, load and engine processors: transformers' ``Qwen2VLProcessor`` (its video processor torch-only offline)
PROCESSORS = qwen2_processors("transformers.models.qwen2_vl.processing_qwen2_vl", "Qwen2VLProcessor")


@hookimpl
def vlmreg_register_families(register):
    register(
        qwen_descriptor(
            name="qwen2_vl",
            model_types=("qwen2_vl",),
            tiny_config=tiny_config,
            language_lora=(*ATTENTION, *DENSE_MLP),
            connectors=("model.visual.merger",),
            projector=("merger.mlp.0", "merger.mlp.2"),
            experts=False,
            thinking_modes=[],
            default_thinking_mode=None,
            thinking_end=None,
            vision_processor_id="Qwen/Qwen2-VL-7B-Instruct",
            vision_processor_ids={
                "*Qwen2-VL-2B-Instruct*": "Qwen/Qwen2-VL-2B-Instruct",
                "*Qwen2-VL-72B-Instruct*": "Qwen/Qwen2-VL-72B-Instruct",
                "*Qwen2-VL-2B": "Qwen/Qwen2-VL-2B",
                "*Qwen2-VL-7B": "Qwen/Qwen2-VL-7B",
                "*Qwen2-VL-72B": "Qwen/Qwen2-VL-72B",
            },
            legacy_checkpoint_names=True,
            processors=PROCESSORS,
            max_videos_per_message=4,
            vllm_video_wrapper=None,  # vLLM's Qwen2-VL prompt update replaces the video pad alone, as the processor
            description=__doc__.split("\n\n", 1)[1].strip(),
        )
    )
