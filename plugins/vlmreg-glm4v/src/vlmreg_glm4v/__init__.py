"""The GLM-4.1V family for vlmreg (``Glm4vForConditionalGeneration``, model_type ``glm4v``).

GLM-4.1V-9B-Thinking and GLM-4.1V-9B-Base (zai-org/, formerly THUDM/): a 24-block ViT on 14-pixel patches with 2-D
rope and interpolated position embeddings, a 2x2 convolution that merges patches and a gated-MLP merger into the
language model's width, and a GLM-4 decoder (fused ``gate_up_proj``, extra norms after attention and MLP, partial
3-D rope over (temporal, height, width) positions). The Thinking checkpoint always reasons: it writes
``<think>...</think>`` and then ``<answer>...</answer>``; the Base checkpoint has no thinking mode.

Descriptor facts, each checked by this plugin's tests:

- The layout is the Qwen2-VL-style one transformers 5 gives: ``model.visual`` (patch_embed, blocks, downsample,
  merger), ``model.language_model`` (embed_tokens, layers, norm), ``lm_head``. The published checkpoints use these
  same names (transformers' GLM-4.1V conversion script writes them; vLLM's ``glm4_1v.py`` loader maps exactly
  ``model.language_model.``, ``model.visual.`` and ``lm_head.``, with a fused ``gate_up_proj``), and so does
  ``save_pretrained``: weights go on the wire under their in-memory names, the default ``checkpoint_weights``.
- The projector is ``model.visual.merger`` (``proj``, ``gate_proj``, ``up_proj``, ``down_proj``), inside the vision
  tower: it is the connector, which ``language+projector`` adapts and ``freeze_vision_encoder`` leaves trainable.
- Positions are 3-D: `vlmreg_glm4v.positions` asks the model's ``get_rope_index`` per sample (packed rows included);
  attention is causal everywhere, image tokens too, so packed rows are exact.
- The chat template renders an image as ``<|begin_of_image|><|image|><|end_of_image|>`` and the processor expands
  ``<|image|>`` (its ``image_token``). No token closes an assistant turn: the next turn's role token does, which the
  model samples, so ``<|user|>`` (then ``<|observation|>``) are the turn-end tokens, as in GLM's generation config.
- ``thinking_end`` is ``</think>``: rewards see ``<answer>...</answer>`` with its markers (vlmreg has no answer
  markers to strip; a reward for this family reads the answer inside them).
- Processors: ``Glm4vProcessor`` needs a video processor, hence torchvision; `vlmreg_glm4v.processor` builds the same
  class without it, with transformers' PIL image processor, for the tiny asset and for real checkpoints alike.
"""

from __future__ import annotations

from typing import Any

from vlmreg import FamilyDescriptor, LoraPreset, ThinkingMode, VisionTokens, hookimpl
from vlmreg.sdk import pixel_bounds, resized_like_processor

__version__ = "0.1.0"

LANGUAGE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
#: The merger's linear layers (``model.visual.merger``), named with their parent so no vision block matches.
PROJECTOR = ("merger.proj", "merger.gate_proj", "merger.up_proj", "merger.down_proj")
#: Thinking checkpoints reason in every answer; every other checkpoint (Base, a random init) answers directly.
THINKING = "*-Thinking*"

#: Checkpoint name patterns -> the processor published with them (the first match wins; default the Thinking one).
PROCESSOR_IDS = {
    "THUDM/GLM-4.1V-9B-Base*": "THUDM/GLM-4.1V-9B-Base",
    "THUDM/GLM-4.1V-9B-Thinking*": "THUDM/GLM-4.1V-9B-Thinking",
    "*GLM-4.1V-9B-Base*": "zai-org/GLM-4.1V-9B-Base",
    "*GLM-4.1V-9B-Thinking*": "zai-org/GLM-4.1V-9B-Thinking",
}


def tiny_config() -> Any:
    """A tiny ``Glm4vConfig`` of the real architecture (about 200k parameters): 2 decoder layers of hidden size 64
    with GLM-4.1V's partial rotary factor 0.5 (4 of each head's 8 rotary frequencies in M-RoPE sections [2, 1, 1]),
    a 2-block vision tower of width 32 on 14-pixel patches, and the tiny vocabulary's token ids."""
    # deferred: start-up cost (loads transformers)
    from transformers import Glm4vConfig  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (vlmreg_glm4v.vocab)
    from vlmreg_glm4v import vocab as v  # noqa: PLC0415

    return Glm4vConfig(
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "num_heads": 2,
            "intermediate_size": 128,
            "out_hidden_size": 64,
            "image_size": 56,
            "patch_size": v.PATCH_SIZE,
            "spatial_merge_size": v.MERGE_SIZE,
            "temporal_patch_size": v.TEMPORAL_PATCH_SIZE,
        },
        text_config={
            "vocab_size": v.VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [2, 1, 1],
                "partial_rotary_factor": 0.5,
            },
            "pad_token_id": v.PAD_ID,
            "eos_token_id": v.EOS_ID,
            # transformers always gives q/k/v a bias; vLLM's GLM-4 builds one only when the config says so (as the
            # published configs do) and otherwise drops the trained biases on load without a word
            "attention_bias": True,
        },
        image_token_id=v.IMAGE_ID,
        video_token_id=v.VIDEO_ID,
        image_start_token_id=v.IMAGE_START_ID,
        image_end_token_id=v.IMAGE_END_ID,
        video_start_token_id=v.VIDEO_START_ID,
        video_end_token_id=v.VIDEO_END_ID,
    )


def resized_for_engine(processor: Any, image: Any) -> Any:
    """The image a rollout server gets: at the size GLM-4.1V's processor resizes it to (its ``smart_resize``, with the
    temporal patch), resized as that processor does (`vlmreg.sdk.images`): vLLM's torchvision-backed processor then
    resizes nothing (measured through vLLM before: logprobs off by 2.2-3.9e-3 in fp32 with images)."""
    # deferred: start-up cost (loads transformers)
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize  # noqa: PLC0415

    ip = processor.image_processor
    low, high = pixel_bounds(ip)
    temporal = ip.temporal_patch_size
    height, width = smart_resize(
        num_frames=temporal,
        height=image.height,
        width=image.width,
        temporal_factor=temporal,
        factor=ip.patch_size * ip.merge_size,
        min_pixels=low,
        max_pixels=high,
    )
    return resized_like_processor(processor, image, height, width)


def tiny_processor() -> Any:
    # deferred: start-up cost (loads transformers)
    from vlmreg_glm4v.processor import tiny_processor as build  # noqa: PLC0415

    return build()


def load_processor(directory: Any) -> Any:
    # deferred: start-up cost (loads transformers)
    from vlmreg_glm4v.processor import load_processor as load  # noqa: PLC0415

    return load(directory)


def engine_processor(processor: Any) -> Any:
    # deferred: start-up cost (loads transformers)
    from vlmreg_glm4v.processor import engine_processor as build  # noqa: PLC0415

    return build(processor)


def init_random_weights(model: Any) -> None:
    """Give the merger's gated MLP (``gate_proj``, ``up_proj``, ``down_proj``) a variance-preserving normal init, std
    1/sqrt(fan_in), after a random init (never for a checkpoint).

    transformers draws every linear layer from N(0, 0.02); the merger stacks three of them behind a LayerNorm, so a
    random init hands the decoder image features of norm about 0.007 against token embeddings of 0.16 in the tiny
    model: the pixels barely reach the logits, and the tiny model does not learn the colour task in 100 steps. With
    this init the features have norm about 1.4 and it does."""
    merger = model.get_submodule("model.visual.merger")
    for linear in (merger.gate_proj, merger.up_proj, merger.down_proj):
        linear.weight.normal_(0.0, linear.in_features**-0.5)


def position_ids(model: Any, inputs: Any) -> Any:
    # deferred: start-up cost (loads torch)
    from vlmreg_glm4v.positions import rope_position_ids  # noqa: PLC0415

    return rope_position_ids(model, inputs)


def descriptor() -> FamilyDescriptor:
    return FamilyDescriptor(
        name="glm4v",
        model_types=("glm4v",),
        vision_encoder_attr="model.visual",
        language_model_attr="model.language_model",
        layers_attr="layers",
        lm_head_attr="lm_head",
        connector_attrs=("model.visual.merger",),
        vision_blocks_attr="blocks",
        tiny_config=tiny_config,
        tiny_processor=tiny_processor,
        load_processor=load_processor,
        engine_processor=engine_processor,
        position_ids=position_ids,
        init_random_weights=init_random_weights,
        lora_presets={
            "language": LoraPreset(modules=LANGUAGE, description="attention and MLP projections of the GLM-4 decoder"),
            "language+projector": LoraPreset(
                modules=(*LANGUAGE, *PROJECTOR),
                scopes=("language_model", "connectors"),
                description="the decoder's projections and the merger's linear layers",
            ),
            "all-linear": LoraPreset(
                modules=("all-linear",),
                scopes=("language_model", "vision_encoder", "connectors"),
                description="every linear layer: decoder, vision blocks and merger",
            ),
        },
        default_lora_preset="language",
        max_images_per_message=16,
        vision_processor_id="zai-org/GLM-4.1V-9B-Thinking",
        vision_processor_ids=PROCESSOR_IDS,
        thinking_modes=(
            ThinkingMode("off", checkpoints=("*", "!" + THINKING)),
            ThinkingMode("on", checkpoints=(THINKING,)),
        ),
        default_thinking_mode="off",
        thinking_end="</think>",
        thinking_start="<think>",
        vision_tokens=VisionTokens(
            image="<|image|>", video="<|video|>", start="<|begin_of_image|>", end="<|end_of_image|>"
        ),
        turn_end_tokens=("<|user|>", "<|observation|>"),
        packing=True,
        transformers_range=">=5.17,<6",
        # vLLM 0.24's CUDA M-RoPE kernel (taken with --enforce-eager, whose custom ops are on) pairs each dimension with
        # the one half a rotary width away, where GLM rotates neighbouring pairs (its own native path does): measured
        # logprobs off by 2.7e-2 (text) to 1.0e-1 in fp32. With the rotary custom op off, vLLM runs the native path.
        engine_image=resized_for_engine,
        vllm_args=("--compilation-config", '{"custom_ops": ["-rotary_embedding"]}'),
        description=__doc__.split("\n\n", 2)[1].strip(),
    )


@hookimpl
def vlmreg_register_families(register):
    register(descriptor())
