"""The Gemma 3 family for vlmreg (``Gemma3ForConditionalGeneration``, model_type ``gemma3``).

Gemma 3 4B, 12B and 27B (IT and PT) and MedGemma: a SigLIP vision tower, a projector that average-pools each
image to a fixed number of soft tokens and multiplies them by one matrix, and a Gemma 3 decoder that interleaves
sliding-window and full-attention layers. Image tokens attend to each other bidirectionally. No thinking mode.

Descriptor facts, each checked by this plugin's tests:

- The projector has no ``nn.Linear``: it is ``mm_soft_emb_norm`` (an RMSNorm) and one parameter,
  ``mm_input_projection_weight``, which LoRA reaches through peft's ``target_parameters``. A random init sets that
  matrix to zeros, so no pixel would reach the logits before the first step; ``init_random_weights`` gives it the
  config's normal init instead.
- ``packing=False``: the bidirectional attention over each image's tokens comes from ``token_type_ids``, which a
  packed row's block-diagonal causal mask cannot express; micro-batches are padded and every forward gets
  transformers' own masks (sliding windows and image blocks).
- An image renders as ``<start_of_image>`` (the processor's ``boi_token``), so that is ``image_placeholder``;
  turns end with ``<end_of_turn>``.
- Weights go on the wire under the published checkpoints' names (`vlmreg_gemma3.weights`).
- Processors: ``Gemma3Processor`` has no video processor, and the PIL image processor loads from a real
  checkpoint's ``preprocessor_config.json`` without torchvision, so ``AutoProcessor`` gives the full processor
  and no ``load_processor`` is needed. The tiny processor is the real ``Gemma3Processor`` with a word-level
  tokenizer built here, offline (see `vlmreg_gemma3.processor`): the smallest correct processor, made by
  this plugin because Gemma's tokenizer cannot be downloaded.
"""

from __future__ import annotations

from typing import Any

from vlmreg import FamilyDescriptor, LoraPreset, VisionTokens, hookimpl

__version__ = "0.1.0"

SLIDING_WINDOW = 16
LANGUAGE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROJECTOR_MATRIX = "mm_input_projection_weight"

#: Checkpoint name patterns -> the processor published with them (the first match wins; default gemma-3-4b-it).
PROCESSOR_IDS = {
    "*gemma-3-4b-pt*": "google/gemma-3-4b-pt",
    "*gemma-3-12b-pt*": "google/gemma-3-12b-pt",
    "*gemma-3-27b-pt*": "google/gemma-3-27b-pt",
    "*gemma-3-12b-it*": "google/gemma-3-12b-it",
    "*gemma-3-27b-it*": "google/gemma-3-27b-it",
    "*medgemma-4b-pt*": "google/medgemma-4b-pt",
    "*medgemma-4b*": "google/medgemma-4b-it",
    "*medgemma-27b*": "google/medgemma-27b-it",
}


def tiny_config() -> Any:
    """A tiny ``Gemma3Config`` of the real architecture: 2 decoder layers (one sliding-window, one full attention),
    hidden size 64, and a 2-layer SigLIP without the pooling head (as in the published configs) on 32x32 images."""
    # deferred: start-up cost (loads transformers)
    from transformers import Gemma3Config  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (vlmreg_gemma3.processor)
    from vlmreg_gemma3 import processor as p  # noqa: PLC0415

    return Gemma3Config(
        text_config={
            "vocab_size": p.VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            # 32, not 16: vLLM 0.24's TRITON_ATTN backend (fp32, bidirectional image blocks) takes head sizes from 32;
            # with 16 only FlexAttention did, whose compiled graph hits torch's recompile limit on a third image shape
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": SLIDING_WINDOW,
            "max_position_embeddings": 4096,
            "pad_token_id": p.PAD_ID,
            "eos_token_id": p.EOS_ID,
            "bos_token_id": p.BOS_ID,
        },
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": p.IMAGE_SIZE,
            "patch_size": p.PATCH_SIZE,
            "vision_use_head": False,
        },
        mm_tokens_per_image=p.TOKENS_PER_IMAGE,
        boi_token_index=p.BOI_ID,
        eoi_token_index=p.EOI_ID,
        image_token_index=p.IMAGE_ID,
        pad_token_id=p.PAD_ID,
        eos_token_id=p.EOS_ID,
        bos_token_id=p.BOS_ID,
    )


def tiny_processor() -> Any:
    # deferred: `vlmreg` starts without it (vlmreg_gemma3.processor)
    from vlmreg_gemma3.processor import tiny_processor as build  # noqa: PLC0415

    return build()


def init_random_weights(model: Any) -> None:
    """Give the projector matrix the config's normal init (transformers zeroes it, cutting the pixels off)."""
    projector = model.get_submodule("model.multi_modal_projector")
    getattr(projector, PROJECTOR_MATRIX).normal_(0.0, model.config.text_config.initializer_range)


def checkpoint_weights(weights: Any) -> Any:
    # deferred: `vlmreg` starts without it (vlmreg_gemma3.weights)
    from vlmreg_gemma3.weights import checkpoint_weights as to_checkpoint  # noqa: PLC0415

    return to_checkpoint(weights)


def memory_weights(weights: Any) -> Any:
    # deferred: `vlmreg` starts without it (vlmreg_gemma3.weights)
    from vlmreg_gemma3.weights import memory_weights as to_memory  # noqa: PLC0415

    return to_memory(weights)


def descriptor() -> FamilyDescriptor:
    return FamilyDescriptor(
        name="gemma3",
        model_types=("gemma3",),
        vision_encoder_attr="model.vision_tower",
        language_model_attr="model.language_model",
        lm_head_attr="lm_head",
        connector_attrs=("model.multi_modal_projector",),
        vision_blocks_attr="encoder.layers",
        tiny_config=tiny_config,
        tiny_processor=tiny_processor,
        init_random_weights=init_random_weights,
        checkpoint_weights=checkpoint_weights,
        memory_weights=memory_weights,
        lora_presets={
            "language": LoraPreset(modules=LANGUAGE, description="attention and MLP projections of the decoder"),
            "language+projector": LoraPreset(
                modules=LANGUAGE,
                parameters=(PROJECTOR_MATRIX,),
                scopes=("language_model", "connectors"),
                description="the decoder's projections and the projector's matrix (a parameter: the projector has no "
                "nn.Linear)",
            ),
            "all-linear": LoraPreset(
                modules=("all-linear",),
                parameters=(PROJECTOR_MATRIX,),
                scopes=("language_model", "vision_encoder", "connectors"),
                description="every nn.Linear of the decoder and the SigLIP tower, and the projector's matrix",
            ),
        },
        default_lora_preset="language",
        max_images_per_message=8,
        vision_processor_id="google/gemma-3-4b-it",
        vision_processor_ids=PROCESSOR_IDS,
        vision_tokens=VisionTokens(image="<image_soft_token>", start="<start_of_image>", end="<end_of_image>"),
        image_placeholder="<start_of_image>",
        turn_end_tokens=("<end_of_turn>",),
        packing=False,
        transformers_range=">=5.17,<6",
        description=__doc__.split("\n\n", 2)[1].strip(),
    )


@hookimpl
def vlmreg_register_families(register):
    register(descriptor())
