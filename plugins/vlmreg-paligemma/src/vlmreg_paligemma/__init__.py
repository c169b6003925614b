"""The PaliGemma family for vlmreg (``PaliGemmaForConditionalGeneration``, model_type ``paligemma``).

PaliGemma 2 (pt and mix checkpoints, 3B, 10B, 28B) and PaliGemma 1: a SigLIP vision tower, one linear projector,
and a Gemma decoder (Gemma 2 for PaliGemma 2) that reads the image tokens and the prompt as one prefix, attended
bidirectionally, and writes the answer causally after it (a prefix LM). Single-image, single-turn. No thinking mode.

Descriptor facts, each checked by this plugin's tests:

- ``prefix_lm="token_type_ids"``: the prompt (images and text) is attended bidirectionally, marked 0 in that input, and
  the answer causally, marked 1, as the processor writes a ``suffix`` and transformers' ``generate`` marks sampled
  tokens. It also lifts two requirements of the processor contract: ``PaliGemmaProcessor`` refuses text without
  images and writes a prompt only as a whole (every image, then ``<bos>``, the text and ``"\\n"``), so vlmreg takes
  each prompt as the processor encodes it, and an episode takes one turn.
- ``packing=False``: a packed row cannot express the prefix's bidirectional attention (the descriptor requires it
  with ``prefix_lm``); micro-batches are padded and get transformers' own masks.
- ``position_ids``: PaliGemma counts positions from 1 (its forward and ``generate`` both do); vlmreg's default
  counts from 0. Rotary positions see only differences, so the offset changes no logit, but the family gives the
  model's own numbering.
- Turns end with ``<eos>`` (the tokenizer's eos, the end of a ``suffix``).
- Weights go on the wire under the published checkpoints' names (`vlmreg_paligemma.weights`).
- Processors: ``PaliGemmaProcessor`` has no video processor, and the PIL SigLIP image processor loads from a
  checkpoint's ``preprocessor_config.json`` without torchvision, so ``AutoProcessor`` gives the full processor. The
  published checkpoints ship no chat template: give ``model.processor`` one that renders a user turn's images as
  ``<image>`` before its text (see `vlmreg_paligemma.processor.CHAT_TEMPLATE`). The tiny processor is the real
  ``PaliGemmaProcessor`` with a word-level tokenizer built here, offline (see `vlmreg_paligemma.processor`).
"""

from __future__ import annotations

from typing import Any

from vlmreg import FamilyDescriptor, LoraPreset, VisionTokens, hookimpl

__version__ = "0.1.0"

SLIDING_WINDOW = 16
LANGUAGE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONNECTOR = ("linear",)

#: Checkpoint name patterns -> the processor published with them (the first match wins; default paligemma2-3b-mix-224).
PROCESSOR_IDS = {
    "*paligemma2-3b-pt-224*": "google/paligemma2-3b-pt-224",
    "*paligemma2-3b-pt-448*": "google/paligemma2-3b-pt-448",
    "*paligemma2-3b-pt-896*": "google/paligemma2-3b-pt-896",
    "*paligemma2-3b-mix-448*": "google/paligemma2-3b-mix-448",
    "*paligemma2-10b-pt-224*": "google/paligemma2-10b-pt-224",
    "*paligemma2-10b-mix-224*": "google/paligemma2-10b-mix-224",
    "*paligemma2-10b-mix-448*": "google/paligemma2-10b-mix-448",
    "*paligemma2-28b-pt-224*": "google/paligemma2-28b-pt-224",
    "*paligemma2-28b-mix-224*": "google/paligemma2-28b-mix-224",
    "*paligemma2-28b-mix-448*": "google/paligemma2-28b-mix-448",
    "*paligemma-3b-mix-224*": "google/paligemma-3b-mix-224",
    "*paligemma-3b-pt-224*": "google/paligemma-3b-pt-224",
}


def tiny_config() -> Any:
    """A tiny ``PaliGemmaConfig`` of PaliGemma 2's architecture, from transformers' own config classes: a 2-layer
    Gemma 2 decoder (one sliding-window and one full-attention layer, with its logit soft-capping) of hidden size 64,
    and a 2-layer SigLIP without the pooling head on 32x32 images in 8x8 patches (16 image tokens)."""
    # deferred: start-up cost (loads transformers)
    from transformers import Gemma2Config, PaliGemmaConfig, SiglipVisionConfig  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (vlmreg_paligemma.processor)
    from vlmreg_paligemma import processor as p  # noqa: PLC0415

    text = Gemma2Config(
        vocab_size=p.VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=SLIDING_WINDOW,
        max_position_embeddings=4096,
        pad_token_id=p.PAD_ID,
        eos_token_id=p.EOS_ID,
        bos_token_id=p.BOS_ID,
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=p.IMAGE_SIZE,
        patch_size=p.PATCH_SIZE,
        vision_use_head=False,
    )
    return PaliGemmaConfig(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_index=p.IMAGE_ID,
        vocab_size=p.VOCAB_SIZE,
        projection_dim=64,
        hidden_size=64,
        pad_token_id=p.PAD_ID,
        eos_token_id=p.EOS_ID,
        bos_token_id=p.BOS_ID,
    )


def tiny_processor() -> Any:
    # deferred: `vlmreg` starts without it (vlmreg_paligemma.processor)
    from vlmreg_paligemma.processor import tiny_processor as build  # noqa: PLC0415

    return build()


def position_ids(model: Any, inputs: Any) -> Any:
    """Positions from 1 over the attended tokens, as ``PaliGemmaModel.forward`` (``arange + 1``) and its ``generate``
    (the attention mask's running count, plus 1) number them."""
    mask = inputs["attention_mask"]
    return mask.long().cumsum(-1).clamp(min=1)


def checkpoint_weights(weights: Any) -> Any:
    # deferred: `vlmreg` starts without it (vlmreg_paligemma.weights)
    from vlmreg_paligemma.weights import checkpoint_weights as to_checkpoint  # noqa: PLC0415

    return to_checkpoint(weights)


def memory_weights(weights: Any) -> Any:
    # deferred: `vlmreg` starts without it (vlmreg_paligemma.weights)
    from vlmreg_paligemma.weights import memory_weights as to_memory  # noqa: PLC0415

    return to_memory(weights)


def descriptor() -> FamilyDescriptor:
    return FamilyDescriptor(
        name="paligemma",
        model_types=("paligemma",),
        vision_encoder_attr="model.vision_tower",
        language_model_attr="model.language_model",
        lm_head_attr="lm_head",
        connector_attrs=("model.multi_modal_projector",),
        vision_blocks_attr="encoder.layers",
        tiny_config=tiny_config,
        tiny_processor=tiny_processor,
        position_ids=position_ids,
        checkpoint_weights=checkpoint_weights,
        memory_weights=memory_weights,
        lora_presets={
            "language": LoraPreset(modules=LANGUAGE, description="attention and MLP projections of the decoder"),
            "language+projector": LoraPreset(
                modules=(*LANGUAGE, *CONNECTOR),
                scopes=("language_model", "connectors"),
                description="the decoder's projections and the projector's linear layer",
            ),
            "all-linear": LoraPreset(
                modules=("all-linear",),
                scopes=("language_model", "vision_encoder", "connectors"),
                description="every nn.Linear of the decoder, the SigLIP tower and the projector",
            ),
        },
        default_lora_preset="language",
        max_images_per_message=1,
        vision_processor_id="google/paligemma2-3b-mix-224",
        vision_processor_ids=PROCESSOR_IDS,
        vision_tokens=VisionTokens(image="<image>"),
        prefix_lm="token_type_ids",
        packing=False,
        transformers_range=">=5.17,<6",
        # measured with `vlmreg check --engine vllm` on the GPU machine (BENCHMARKS.md, "Every family through vLLM
        # 0.24", 2026-11-27)
        vllm_unsupported=(
            "vLLM 0.24.0 cannot start a PaliGemma model with transformers 5.17 or later, the range this family needs: "
            "its paligemma.py asks vision.py for the SigLIP encoder's info, which imports "
            "vllm/model_executor/models/pixtral.py, and that imports PixtralRotaryEmbedding from "
            "transformers.models.pixtral.modeling_pixtral, which no longer has it (the server exits at start-up)"
        ),
        description=__doc__.split("\n\n", 2)[1].strip(),
    )


@hookimpl
def vlmreg_register_families(register):
    register(descriptor())
