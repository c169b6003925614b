"""The LLaVA-OneVision family for vlmreg (``LlavaOnevisionForConditionalGeneration``, model_type ``llava_onevision``).

The llava-hf checkpoints ``llava-hf/llava-onevision-qwen2-{0.5b,7b,72b}-ov-hf``, the single-image ``-si-hf`` ones and
the ``-7b-ov-chat-hf`` / ``-72b-ov-chat-hf`` chat tunes: a SigLIP vision tower (no pooling head) on 384 px tiles with
anyres tiling (the image plus up to 6x6 tiles chosen by aspect ratio, features shrunk past ``anyres_max_9``), a
two-layer GELU projector, a learned ``image_newline`` closing each row of features, and a Qwen2 decoder. No thinking
modes: the ChatML templates have none.

Descriptor facts, each checked by this plugin's tests:

- Module tree: ``model.vision_tower`` (SigLIP, blocks ``encoder.layers``), ``model.multi_modal_projector``
  (``linear_1``, ``linear_2``), ``model.image_newline`` (a parameter), ``model.language_model`` (embed_tokens,
  layers, norm), ``lm_head``.
- The chat template renders ``<image>`` for an image (the processor's image token, so no ``image_placeholder``); the
  processor expands it to one ``<image>`` per feature, a count that depends on the image's size. Turns end with
  ``<|im_end|>``.
- Every image is tiled (anyres) however many share a prompt, as vLLM does and as vlmreg's per-image expansion needs
  (`vlmreg_llava_onevision.processor` says why and what differs from transformers' processor).
- The decoder is causal Qwen2 with 1-D positions and image tokens are causal too, so packed rows are exact
  (``packing=True``).
- ``model.image_newline`` is a bare parameter of the connector (LLaVA trains it with the projector), named in
  ``connector_parameters``: it trains, freezes with ``freeze_connectors`` and is sent with the projector.
- Weights go on the wire under the published checkpoints' names (`vlmreg_llava_onevision.weights`), every one of them.
- Processors: ``LlavaOnevisionProcessor`` insists on a video processor (torchvision); the tiny processor and
  ``load_processor`` are it without one, with transformers' PIL image processor; ``engine_processor`` adds the video
  processor back for vLLM (needs torchvision). The tiny tokenizer is a small BPE shipped with this plugin.
"""

from __future__ import annotations

from typing import Any

from vlmreg import FamilyDescriptor, LoraPreset, VisionTokens, hookimpl

__version__ = "0.1.0"

LANGUAGE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROJECTOR = ("multi_modal_projector.linear_1", "multi_modal_projector.linear_2")

#: Checkpoint name patterns -> the processor published with them (the first match wins; default the 0.5b ov one).
#: All share Qwen2's tokenizer with <image>/<video> at 151646/151647; the chat tunes ship their own template.
PROCESSOR_IDS = {
    **{
        f"*llava-onevision-qwen2-{size}-ov-chat-hf*": f"llava-hf/llava-onevision-qwen2-{size}-ov-chat-hf"
        for size in ("7b", "72b")
    },
    **{
        f"*llava-onevision-qwen2-{size}-{stage}-hf*": f"llava-hf/llava-onevision-qwen2-{size}-{stage}-hf"
        for size in ("0.5b", "7b", "72b")
        for stage in ("ov", "si")
    },
}


def tiny_config() -> Any:
    """A tiny ``LlavaOnevisionConfig`` of the real architecture: 2 Qwen2 layers of hidden size 64 with an untied head
    (as the 7b/72b checkpoints), a 2-layer SigLIP tower of hidden size 32 (no head) on 24 px tiles in 8 px patches,
    the last layer's features, all of them (``full``), anyres over a small grid of pinpoints (``anyres_max_9``)."""
    # deferred: start-up cost (loads transformers)
    from transformers import LlavaOnevisionConfig  # noqa: PLC0415

    # deferred: start-up cost (loads transformers)
    from vlmreg_llava_onevision import processor as p  # noqa: PLC0415

    return LlavaOnevisionConfig(
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": p.TILE_SIZE,
            "patch_size": p.PATCH_SIZE,
            "vision_use_head": False,
        },
        text_config={
            "model_type": "qwen2",
            "vocab_size": p.VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "layer_types": ["full_attention", "full_attention"],
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "pad_token_id": p.PAD_ID,
            "bos_token_id": p.BOS_ID,
            "eos_token_id": p.EOS_ID,
        },
        image_token_index=p.IMAGE_ID,
        video_token_index=p.VIDEO_ID,
        vision_feature_layer=-1,  # the last layer, as in every published config
        vision_feature_select_strategy="full",
        image_grid_pinpoints=[list(x) for x in p.GRID_PINPOINTS],
        vision_aspect_ratio=p.VISION_ASPECT_RATIO,
        tie_word_embeddings=False,
    )


def tiny_processor() -> Any:
    # deferred: start-up cost (loads transformers)
    from vlmreg_llava_onevision.processor import tiny_processor as build  # noqa: PLC0415

    return build()


def load_processor(directory: Any) -> Any:
    # deferred: start-up cost (loads transformers)
    from vlmreg_llava_onevision.processor import load_processor as load  # noqa: PLC0415

    return load(directory)


def engine_processor(processor: Any) -> Any:
    # deferred: start-up cost (loads transformers)
    from vlmreg_llava_onevision.processor import engine_processor as full  # noqa: PLC0415

    return full(processor)


def checkpoint_weights(weights: Any) -> Any:
    # deferred: `vlmreg` starts without it (vlmreg_llava_onevision.weights)
    from vlmreg_llava_onevision.weights import checkpoint_weights as to_checkpoint  # noqa: PLC0415

    return to_checkpoint(weights)


def memory_weights(weights: Any) -> Any:
    # deferred: `vlmreg` starts without it (vlmreg_llava_onevision.weights)
    from vlmreg_llava_onevision.weights import memory_weights as to_memory  # noqa: PLC0415

    return to_memory(weights)


def descriptor() -> FamilyDescriptor:
    return FamilyDescriptor(
        name="llava_onevision",
        model_types=("llava_onevision",),
        vision_encoder_attr="model.vision_tower",
        language_model_attr="model.language_model",
        layers_attr="layers",
        lm_head_attr="lm_head",
        connector_attrs=("model.multi_modal_projector",),
        connector_parameters=("model.image_newline",),
        vision_blocks_attr="encoder.layers",
        tiny_config=tiny_config,
        tiny_processor=tiny_processor,
        load_processor=load_processor,
        engine_processor=engine_processor,
        checkpoint_weights=checkpoint_weights,
        memory_weights=memory_weights,
        lora_presets={
            "language": LoraPreset(modules=LANGUAGE, description="attention and MLP projections of the decoder"),
            "language+projector": LoraPreset(
                modules=(*LANGUAGE, *PROJECTOR),
                scopes=("language_model", "connectors"),
                description="the decoder's projections and the projector's two linear layers",
            ),
            "all-linear": LoraPreset(
                modules=("all-linear",),
                scopes=("language_model", "vision_encoder", "connectors"),
                description="every linear layer: decoder, SigLIP tower and projector",
            ),
        },
        default_lora_preset="language",
        max_images_per_message=4,
        vision_processor_id="llava-hf/llava-onevision-qwen2-0.5b-ov-hf",
        vision_processor_ids=PROCESSOR_IDS,
        vision_tokens=VisionTokens(image="<image>", video="<video>"),
        turn_end_tokens=("<|im_end|>",),
        packing=True,
        transformers_range=">=5.17,<6",
        # measured with `vlmreg check --engine vllm` on the GPU machine (BENCHMARKS.md, "Every family through vLLM
        # 0.24")
        vllm_unsupported=(
            "vLLM 0.24.0 cannot import its LLaVA model module with transformers 5.17 or later, the range this family "
            "needs: vllm/model_executor/models/pixtral.py imports PixtralRotaryEmbedding and position_ids_in_meshgrid "
            "from transformers.models.pixtral.modeling_pixtral, which no longer has them, so vLLM's inspection of "
            "LlavaOnevisionForConditionalGeneration fails at start-up"
        ),
        description=__doc__.split("\n\n", 2)[1].strip(),
    )


@hookimpl
def vlmreg_register_families(register):
    register(descriptor())
