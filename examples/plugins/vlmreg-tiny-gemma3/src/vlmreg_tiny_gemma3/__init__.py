"""Gemma 3 (a SigLIP vision tower, a pooling projector and a Gemma 3 decoder) as a vlmreg family.

What is real: the architecture class (``Gemma3ForConditionalGeneration``, model_type ``gemma3``), the
processor class (``Gemma3Processor`` with the PIL ``Gemma3ImageProcessorPil``), Gemma 3 IT's chat template
and its image scheme (``<start_of_image>`` expanded to a blank line, ``<start_of_image>``, the soft image tokens,
``<end_of_image>`` and a blank line), the ``token_type_ids`` the processor returns, with which image tokens
attend to each other bidirectionally, and the interleaved sliding-window / full-attention layers.

What is tiny and offline: the config (2 decoder layers, one sliding-window layer with a 16-token window and one
full-attention layer; hidden size 64; a 2-layer SigLIP on 32x32 images in 8x8 patches pooled to 4 image tokens)
and the tokenizer (a fixed word list with Gemma's special tokens, built in code; see `processor`).

Descriptor notes: an image renders as ``<start_of_image>`` (the processor's ``boi_token``), so that is the
``image_placeholder``; turns end with ``<end_of_turn>``. Packed rows are not exact for Gemma 3: the
bidirectional attention over image tokens comes from ``token_type_ids``, which a block-diagonal causal packing
mask does not express, so ``packing=False`` (with the image blocks made causal, packed rows do match each sample
alone, sliding window included). The projector has no ``nn.Linear``: it multiplies by one parameter,
``mm_input_projection_weight``, which LoRA reaches as a target parameter. transformers initialises that matrix
to zeros in a random init, so the tiny random model's logits do not depend on the pixels until training has
moved it (the conformance suite's two pixel checks are marked expected failures in ``tests``).
"""

from vlmreg import FamilyDescriptor, LoraPreset, VisionTokens, hookimpl

SLIDING_WINDOW = 16


def tiny_config():
    """A tiny Gemma3Config of the real architecture; imported lazily so `vlmreg families` stays fast."""
    # deferred: start-up cost (loads transformers)
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig  # noqa: PLC0415

    # deferred: start-up cost (loads tokenizers, transformers)
    from vlmreg_tiny_gemma3 import processor as p  # noqa: PLC0415

    return Gemma3Config(
        text_config=Gemma3TextConfig(
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
        ),
        vision_config=SiglipVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=p.IMAGE_SIZE,
            patch_size=p.PATCH_SIZE,
        ),
        mm_tokens_per_image=p.MM_TOKENS_PER_IMAGE,
        boi_token_index=p.BOI_TOKEN_ID,
        eoi_token_index=p.EOI_TOKEN_ID,
        image_token_index=p.IMAGE_TOKEN_ID,
        pad_token_id=p.PAD_ID,
        eos_token_id=p.EOS_ID,
        bos_token_id=p.BOS_ID,
    )


def tiny_processor():
    # deferred: start-up cost (loads tokenizers, transformers)
    from vlmreg_tiny_gemma3.processor import tiny_processor as build  # noqa: PLC0415

    return build()


LANGUAGE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def init_random_weights(model):
    """transformers initialises the projector matrix to zeros in a random init, so no pixel would reach the logits
    (nor any gradient the vision tower) until the first step; give it the config's normal init instead."""
    projector = model.get_submodule("model.multi_modal_projector")
    projector.mm_input_projection_weight.normal_(0.0, model.config.text_config.initializer_range)


@hookimpl
def vlmreg_register_families(register):
    register(
        FamilyDescriptor(
            name="gemma3",
            model_types=["gemma3"],
            vision_encoder_attr="model.vision_tower",
            language_model_attr="model.language_model",
            lm_head_attr="lm_head",
            connector_attrs=["model.multi_modal_projector"],
            vision_blocks_attr="encoder.layers",
            tiny_config=tiny_config,
            tiny_processor=tiny_processor,
            init_random_weights=init_random_weights,
            lora_presets={
                "language": LoraPreset(modules=LANGUAGE, description="attention and MLP projections of the decoder"),
                "language+projector": LoraPreset(
                    modules=LANGUAGE,
                    parameters=("mm_input_projection_weight",),
                    scopes=("language_model", "connectors"),
                    description="the decoder's projections and the projector's matrix (a parameter, not an nn.Linear)",
                ),
                "all-linear": LoraPreset(
                    modules=("all-linear",),
                    parameters=("mm_input_projection_weight",),
                    scopes=("language_model", "vision_encoder", "connectors"),
                    description="every nn.Linear of the decoder and the SigLIP tower, and the projector's matrix (it "
                    "has no nn.Linear)",
                ),
            },
            max_images_per_message=8,
            vision_tokens=VisionTokens(image="<image_soft_token>", start="<start_of_image>", end="<end_of_image>"),
            image_placeholder="<start_of_image>",
            turn_end_tokens=("<end_of_turn>",),
            packing=False,
            transformers_range=">=5.17,<6",
            description="Gemma 3: SigLIP ViT, pooled projector, Gemma 3 decoder (sliding-window and full attention, "
            "bidirectional attention over image tokens).",
        )
    )
