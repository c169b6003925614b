"""The InternVL family for vlmreg (``InternVLForConditionalGeneration``, model_type ``internvl``).

InternVL3 1B-78B (the transformers-format ``OpenGVLab/InternVL3-*-hf`` checkpoints) and InternVL3.5 (``-HF``): an
InternViT vision tower run on 448 px tiles of the image (dynamic high resolution: up to 12 tiles chosen by aspect
ratio, plus a thumbnail), a pixel-shuffle projector (LayerNorm, two linear layers) and a Qwen2.5 / Qwen3 decoder.
No thinking modes: InternVL3's templates have none, and InternVL3.5's thinking is asked for by a system prompt
(which a task's prompt can carry), not by a chat-template switch.

Descriptor facts, each checked by this plugin's tests:

- Module tree: ``model.vision_tower`` (embeddings, ``encoder.layer``), ``model.multi_modal_projector``
  (``layer_norm``, ``linear_1``, ``linear_2``), ``model.language_model`` (embed_tokens, layers, norm), ``lm_head``.
- The chat template renders ``<IMG_CONTEXT>`` for an image (the processor's image token, so no
  ``image_placeholder``); the processor expands it to ``<img>``, ``<IMG_CONTEXT>`` x 256 per tile, ``</img>``.
  The tile count depends on each image's size, and vlmreg gets it from the processor on the image alone.
  Turns end with ``<|im_end|>``.
- The decoder is causal Qwen with 1-D positions and image tokens are causal too, so packed rows are exact
  (``packing=True``).
- Weights go on the wire under the published checkpoints' names (`vlmreg_internvl.weights`).
- Processors: ``InternVLProcessor`` insists on a video processor (torchvision); the tiny processor and
  ``load_processor`` are it without one, with transformers' PIL GotOcr2 image processor
  (`vlmreg_internvl.processor`); ``engine_processor`` adds the video processor back for vLLM (needs torchvision). The
  tiny tokenizer is a small BPE shipped with this plugin, because the real one cannot be downloaded: the smallest
  correct processor.
"""

from __future__ import annotations

from typing import Any

from vlmreg import FamilyDescriptor, LoraPreset, VisionTokens, hookimpl

__version__ = "0.1.0"

LANGUAGE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROJECTOR = ("multi_modal_projector.linear_1", "multi_modal_projector.linear_2")

#: Checkpoint name patterns -> the processor published with them (the first match wins; default InternVL3-1B-hf).
#: InternVL3 uses Qwen2.5's tokenizer, InternVL3.5 Qwen3's (other special-token ids), so each size maps to its own.
PROCESSOR_IDS = {
    **{f"*InternVL3-{size}*": f"OpenGVLab/InternVL3-{size}-hf" for size in ("1B", "2B", "8B", "14B", "38B", "78B")},
    **{f"*InternVL3_5-{size}*": f"OpenGVLab/InternVL3_5-{size}-HF" for size in ("1B", "2B", "4B", "8B", "14B", "38B")},
}


def tiny_config() -> Any:
    """A tiny ``InternVLConfig`` of the real architecture: 2 Qwen2 layers of hidden size 64 with an untied head (as
    the published checkpoints), a 2-layer InternViT of hidden size 32 on 32x32 tiles in 8x8 patches, pixel-shuffled
    by 0.5 into 4 ``<IMG_CONTEXT>`` tokens a tile."""
    # deferred: start-up cost (loads transformers)
    from transformers import InternVLConfig  # noqa: PLC0415

    # deferred: start-up cost (loads transformers)
    from vlmreg_internvl import processor as p  # noqa: PLC0415

    return InternVLConfig(
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
        vision_config={
            "model_type": "internvl_vision",
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "image_size": p.TILE_SIZE,
            "patch_size": p.PATCH_SIZE,
            "attention_bias": True,
        },
        image_token_id=p.IMAGE_ID,
        image_seq_length=p.TOKENS_PER_TILE,
        downsample_ratio=p.DOWNSAMPLE_RATIO,
        vision_feature_layer=-1,  # the last layer, as in every published config
        tie_word_embeddings=False,
    )


def tiny_processor() -> Any:
    # deferred: start-up cost (loads transformers)
    from vlmreg_internvl.processor import tiny_processor as build  # noqa: PLC0415

    return build()


def load_processor(directory: Any) -> Any:
    # deferred: start-up cost (loads transformers)
    from vlmreg_internvl.processor import load_processor as load  # noqa: PLC0415

    return load(directory)


def engine_processor(processor: Any) -> Any:
    # deferred: start-up cost (loads transformers)
    from vlmreg_internvl.processor import engine_processor as full  # noqa: PLC0415

    return full(processor)


def checkpoint_weights(weights: Any) -> Any:
    # deferred: `vlmreg` starts without it (vlmreg_internvl.weights)
    from vlmreg_internvl.weights import checkpoint_weights as to_checkpoint  # noqa: PLC0415

    return to_checkpoint(weights)


def memory_weights(weights: Any) -> Any:
    # deferred: `vlmreg` starts without it (vlmreg_internvl.weights)
    from vlmreg_internvl.weights import memory_weights as to_memory  # noqa: PLC0415

    return to_memory(weights)


def descriptor() -> FamilyDescriptor:
    return FamilyDescriptor(
        name="internvl",
        model_types=("internvl",),
        vision_encoder_attr="model.vision_tower",
        language_model_attr="model.language_model",
        lm_head_attr="lm_head",
        connector_attrs=("model.multi_modal_projector",),
        vision_blocks_attr="encoder.layer",
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
                description="every linear layer: decoder, InternViT and projector",
            ),
        },
        default_lora_preset="language",
        max_images_per_message=8,
        vision_processor_id="OpenGVLab/InternVL3-1B-hf",
        vision_processor_ids=PROCESSOR_IDS,
        vision_tokens=VisionTokens(image="<IMG_CONTEXT>", start="<img>", end="</img>"),
        turn_end_tokens=("<|im_end|>",),
        packing=True,
        transformers_range=">=5.17,<6",
        description=__doc__.split("\n\n", 2)[1].strip(),
    )


@hookimpl
def vlmreg_register_families(register):
    register(descriptor())
