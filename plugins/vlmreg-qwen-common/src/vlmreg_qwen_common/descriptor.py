"""`qwen_descriptor`: the FamilyDescriptor shape shared by the Qwen VLM families.

transformers 5 lays all of them out the same way: ``model.visual`` (patch_embed, blocks, merger),
``model.language_model`` (embed_tokens, layers, norm) and ``lm_head``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vlmreg import ALL_LINEAR, FamilyDescriptor, LoraPreset, ThinkingMode, VideoSampling, VisionTokens

VISION_TOKENS = VisionTokens(
    image="<|image_pad|>", video="<|video_pad|>", start="<|vision_start|>", end="<|vision_end|>"
)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
#: Gated DeltaNet projections of Qwen3.5's linear-attention layers (in_proj_a / in_proj_b are rank-tiny).
LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "out_proj")
SHARED_EXPERT = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
PROJECTOR = ("linear_fc1", "linear_fc2")
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
#: What vLLM 0.24's Qwen3-VL prompt update replaces beside the video pad (the template's whole
#: <|vision_start|><|video_pad|><|vision_end|>; transformers 5's processor replaces only the pad: docs/serving.md).
#: Its Qwen2-VL and Qwen2.5-VL prompt updates replace the pad alone, as the processor does: no wrapper.
QWEN3_VL_VLLM_VIDEO_WRAPPER = ("<|vision_start|>", "<|vision_end|>")


def lora_presets(
    language: Sequence[str], *, experts: bool, projector: Sequence[str] = PROJECTOR
) -> dict[str, LoraPreset]:
    presets = {
        "language": LoraPreset(modules=tuple(language), description="language-model projections"),
        "language+projector": LoraPreset(
            modules=(*language, *projector),
            scopes=("language_model", "connectors"),
            description="language-model projections and the vision-language merger",
        ),
        "all-linear": LoraPreset(
            modules=(ALL_LINEAR,),
            scopes=("language_model", "vision_encoder", "connectors"),
            description="every linear layer, vision blocks and merger included",
        ),
    }
    if experts:
        presets["language+experts"] = LoraPreset(
            modules=tuple(language),
            parameters=FUSED_EXPERTS,
            description="language-model projections and the fused routed experts (peft target_parameters)",
        )
    return presets


def qwen_descriptor(
    *,
    name: str,
    model_types: Sequence[str],
    tiny_config: Callable[[], Any],
    language_lora: Sequence[str],
    connectors: Sequence[str],
    experts: bool,
    thinking_modes: Sequence[ThinkingMode],
    default_thinking_mode: str | None,
    vision_processor_id: str,
    vision_processor_ids: Mapping[str, str] | None = None,
    shapes: Mapping[str, Callable[[], Any]] | None = None,
    linear_attention: bool = False,
    unfused_expert_checkpoints: bool = False,
    transposed_expert_checkpoints: bool = False,
    legacy_checkpoint_names: bool = False,
    projector: Sequence[str] = PROJECTOR,
    processors: tuple[Callable[[], Any], Callable[[Any], Any], Callable[[Any], Any]] | None = None,
    thinking_end: str | None = "</think>",
    max_videos_per_message: int = 0,
    vllm_video_wrapper: tuple[str, str] | None = QWEN3_VL_VLLM_VIDEO_WRAPPER,
    host_vision_inputs: bool = False,
    description: str = "",
) -> FamilyDescriptor:
    """The Qwen descriptor; ``unfused_expert_checkpoints``: checkpoints store one weight per expert;
    ``transposed_expert_checkpoints``: checkpoints store the fused experts transposed (see fused_experts);
    ``legacy_checkpoint_names``: checkpoints use the Qwen2-VL top-level ``visual.*`` / ``model.*`` names (see
    legacy_names); ``projector``: the merger's linear layers (suffixes) for the ``language+projector`` preset;
    ``processors``: the family's own (tiny, load, engine) processor callables instead of the Qwen3-VL ones;
    ``max_videos_per_message``: 0 for a family whose video input vlmreg has not checked against its processor yet
    (more: frames go to a server resized as the family's video processor resizes them, `engine_video`);
    ``vllm_video_wrapper``: the text vLLM's prompt update replaces around a video's pad (the Qwen3-VL one by default;
    ``None`` for Qwen2-VL and Qwen2.5-VL, whose vLLM prompt updates replace the pad alone); ``host_vision_inputs``: the
    vision encoder is a Qwen3-generation one (a learned position grid), whose per-call inputs the trainer derives on
    the host (`vlmreg_qwen_common.vision_inputs`). Video frames are sampled at 2 a second by default, as the Qwen video
    processors do."""
    # deferred: import circle (vlmreg_qwen_common imports vlmreg_qwen_common.descriptor)
    from vlmreg_qwen_common import engine_processor as qwen3_vl_engine_processor  # noqa: PLC0415
    from vlmreg_qwen_common import load_processor as qwen3_vl_load_processor  # noqa: PLC0415
    from vlmreg_qwen_common import (  # noqa: PLC0415
        mrope_position_ids,
        prepare_deepstack,
        prepare_linear_attention,
        prepare_moe,
        prepare_moe_linear_attention,
    )
    from vlmreg_qwen_common import tiny_processor as qwen3_vl_tiny_processor  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (vlmreg_qwen_common.engine_images)
    from vlmreg_qwen_common.engine_images import resized_for_engine  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (vlmreg_qwen_common.engine_videos)
    from vlmreg_qwen_common.engine_videos import frames_for_engine  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (vlmreg_qwen_common.fused_experts)
    from vlmreg_qwen_common.fused_experts import fuse_experts, transpose_experts, unfuse_experts  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (vlmreg_qwen_common.legacy_names)
    from vlmreg_qwen_common.legacy_names import legacy_checkpoint_names as to_legacy  # noqa: PLC0415
    from vlmreg_qwen_common.legacy_names import memory_names  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (vlmreg_qwen_common.vision_inputs)
    from vlmreg_qwen_common.vision_inputs import vision_call_inputs  # noqa: PLC0415

    tiny_processor, load_processor, engine_processor = (
        processors
        if processors is not None
        else (qwen3_vl_tiny_processor, qwen3_vl_load_processor, qwen3_vl_engine_processor)
    )
    names: dict[str, Any] = {}
    if legacy_checkpoint_names:
        names = {"checkpoint_weights": to_legacy, "memory_weights": memory_names}
    elif unfused_expert_checkpoints:
        names = {"checkpoint_weights": unfuse_experts, "memory_weights": fuse_experts}
    elif transposed_expert_checkpoints:
        names = {"checkpoint_weights": transpose_experts, "memory_weights": transpose_experts}

    return FamilyDescriptor(
        name=name,
        model_types=tuple(model_types),
        vision_encoder_attr="model.visual",
        language_model_attr="model.language_model",
        lm_head_attr="lm_head",
        connector_attrs=tuple(connectors),
        vision_blocks_attr="blocks",
        tiny_config=tiny_config,
        tiny_processor=tiny_processor,
        load_processor=load_processor,
        engine_processor=engine_processor,
        shapes=dict(shapes or {}),
        position_ids=mrope_position_ids,
        prepare_model={
            (True, True): prepare_moe_linear_attention,
            (True, False): prepare_linear_attention,
            (False, True): prepare_moe,
            (False, False): prepare_deepstack,
        }[(linear_attention, experts)],
        vision_call_inputs=vision_call_inputs if host_vision_inputs else None,
        lora_presets=lora_presets(language_lora, experts=experts, projector=projector),
        default_lora_preset="language",
        supports_vision=True,
        max_images_per_message=16,
        max_videos_per_message=max_videos_per_message,
        video_sampling=VideoSampling(fps=2.0),
        vision_processor_id=vision_processor_id,
        vision_processor_ids=dict(vision_processor_ids or {}),
        thinking_modes=tuple(thinking_modes),
        default_thinking_mode=default_thinking_mode,
        vision_tokens=VISION_TOKENS,
        turn_end_tokens=("<|im_end|>",),
        thinking_end=thinking_end,
        thinking_start="<think>" if thinking_end is not None else None,
        transformers_range=">=5.17,<6",
        engine_image=resized_for_engine,
        engine_video=frames_for_engine if max_videos_per_message else None,
        vllm_video_wrapper=vllm_video_wrapper if max_videos_per_message else None,
        description=description,
        **names,
    )
