"""The Idefics3 family for vlmreg: Idefics3 and the SmolVLM checkpoints (model_types ``idefics3`` and ``smolvlm``).

SmolVLM (256M, 500M, 2.2B; v1 uses ``Idefics3ForConditionalGeneration``, SmolVLM2 ``SmolVLMForConditionalGeneration``,
the same module tree) and Idefics3-8B: a SigLIP-style vision encoder run on image tiles plus a global view, a
pixel-shuffle connector with one linear projection, and a Llama decoder. No thinking mode.

Descriptor facts, each checked by this plugin's tests:

- Both classes lay out ``model.vision_model`` (embeddings, encoder.layers, post_layernorm), ``model.connector``
  (``modality_projection.proj``), ``model.text_model`` (embed_tokens, layers, norm) and ``lm_head``, in memory and in
  the published checkpoints alike, so weights go on the wire under their in-memory names.
- The chat template renders ``<image>`` for an image (the processor's ``image_token``, so no ``image_placeholder``);
  its expansion starts and ends at ``<fake_token_around_image>``; turns end with ``<end_of_utterance>``.
- Image tensors are collated per image, ``(images, most tiles, ...)`` zero-padded, where the processor gives one
  prompt's tiles in one row, ``(1, all tiles, ...)``; ``processor_layout`` declares that mapping (the model drops
  all-zero tiles, so both read alike), and the prompt check compares through it.
- The decoder is causal Llama with 1-D positions and the image tokens are causal too, so packed rows are exact.
- Processors: the tiny processor is the real ``Idefics3Processor`` with a word-level tokenizer built here, offline
  (see `vlmreg_idefics3.processor`): the smallest correct processor, made by this plugin because SmolVLM's tokenizer
  cannot be downloaded. ``load_processor`` builds SmolVLM2's ``SmolVLMProcessor`` without its video processor,
  which needs torchvision.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vlmreg import FamilyDescriptor, LoraPreset, VisionTokens, hookimpl

__version__ = "0.1.0"

LANGUAGE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONNECTOR = ("modality_projection.proj",)

#: Checkpoint name patterns -> the processor published with them (the first match wins; default SmolVLM-Instruct).
PROCESSOR_IDS = {
    "*SmolVLM-256M*": "HuggingFaceTB/SmolVLM-256M-Instruct",
    "*SmolVLM-500M*": "HuggingFaceTB/SmolVLM-500M-Instruct",
    "*SmolVLM2-256M*": "HuggingFaceTB/SmolVLM2-256M-Video-Instruct",
    "*SmolVLM2-500M*": "HuggingFaceTB/SmolVLM2-500M-Video-Instruct",
    "*SmolVLM2*": "HuggingFaceTB/SmolVLM2-2.2B-Instruct",
    "*Idefics3*": "HuggingFaceM4/Idefics3-8B-Llama3",
}


def tiny_config() -> Any:
    """A tiny ``Idefics3Config`` of the real architecture: 2 Llama layers of hidden size 64, a 2-layer vision encoder
    on 32x32 tiles in 8x8 patches, pixel-shuffled by 2 (4 ``<image>`` tokens a tile)."""
    # deferred: start-up cost (loads transformers)
    from transformers import Idefics3Config  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (vlmreg.sdk.processor_files, vlmreg_idefics3.processor)
    from vlmreg_idefics3 import processor as p  # noqa: PLC0415

    return Idefics3Config(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": p.TILE_SIZE,
            "patch_size": p.PATCH_SIZE,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": p.VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "pad_token_id": p.PAD_ID,
            "bos_token_id": p.BOS_ID,
            "eos_token_id": p.EOS_ID,
        },
        image_token_id=p.IMAGE_ID,
        scale_factor=p.SCALE_FACTOR,
        pad_token_id=p.PAD_ID,
    )


def tiny_processor() -> Any:
    # deferred: `vlmreg` starts without it (vlmreg.sdk.processor_files, vlmreg_idefics3.processor)
    from vlmreg_idefics3.processor import tiny_processor as build  # noqa: PLC0415

    return build()


def load_processor(directory: Any) -> Any:
    # deferred: `vlmreg` starts without it (vlmreg.sdk.processor_files, vlmreg_idefics3.processor)
    from vlmreg_idefics3.processor import load_processor as load  # noqa: PLC0415

    return load(directory)


def processor_layout(collated: Mapping[str, Any]) -> dict[str, Any]:
    """One prompt's tiles as the processor lays them out, from vlmreg's per-image collation.

    vlmreg collates each image's ``(1, tiles, ...)`` tensors on dim 0, zero-padding to the most tiles:
    ``(images, most tiles, ...)``. The processor gives a prompt's tiles in one row: ``(1, all tiles, ...)``. The model
    reads both alike: it flattens the first two dims and drops every all-zero tile
    (``Idefics3Model.get_image_features``), which is what this does, by the same rule.
    """
    pixels, mask = collated["pixel_values"], collated["pixel_attention_mask"]
    tiles = pixels.flatten(0, 1)
    real = tiles.flatten(1).ne(0).any(1)
    return {"pixel_values": tiles[real][None], "pixel_attention_mask": mask.flatten(0, 1)[real][None]}


def descriptor() -> FamilyDescriptor:
    return FamilyDescriptor(
        name="idefics3",
        model_types=("idefics3", "smolvlm"),
        vision_encoder_attr="model.vision_model",
        language_model_attr="model.text_model",
        lm_head_attr="lm_head",
        connector_attrs=("model.connector",),
        vision_blocks_attr="encoder.layers",
        tiny_config=tiny_config,
        tiny_processor=tiny_processor,
        load_processor=load_processor,
        lora_presets={
            "language": LoraPreset(modules=LANGUAGE, description="attention and MLP projections of the decoder"),
            "language+projector": LoraPreset(
                modules=(*LANGUAGE, *CONNECTOR),
                scopes=("language_model", "connectors"),
                description="the decoder's projections and the connector's linear projection",
            ),
            "all-linear": LoraPreset(
                modules=("all-linear",),
                scopes=("language_model", "vision_encoder", "connectors"),
                description="every linear layer: decoder, vision encoder and connector",
            ),
        },
        default_lora_preset="language",
        max_images_per_message=8,
        vision_processor_id="HuggingFaceTB/SmolVLM-Instruct",
        vision_processor_ids=PROCESSOR_IDS,
        vision_tokens=VisionTokens(image="<image>", start="<fake_token_around_image>", end="<fake_token_around_image>"),
        turn_end_tokens=("<end_of_utterance>",),
        processor_layout=processor_layout,
        packing=True,
        transformers_range=">=5.17,<6",
        description=__doc__.split("\n\n", 2)[1].strip(),
    )


@hookimpl
def vlmreg_register_families(register):
    register(descriptor())
