"""Mistral 3 (a Pixtral vision tower at native image sizes, a patch-merging projector and a Mistral decoder) as a vlmreg
family.

What is real: the architecture class (``Mistral3ForConditionalGeneration``, model_type ``mistral3``, as in
Mistral Small 3.1) with a ``PixtralVisionConfig`` tower (2-D RoPE over patches, images at their own size), the
processor class (``PixtralProcessor`` with the PIL ``PixtralImageProcessorPil``) and its image scheme: a row of
``[IMG]`` tokens per 16 px of height, rows ended by ``[IMG_BREAK]`` and the image by ``[IMG_END]``, so images of
different sizes give different token grids; Mistral's control-token ids (``[IMG]`` = 10); turns end with ``</s>``.

What is tiny and offline: the config (2 Mistral layers of hidden size 64; a 2-layer Pixtral tower with 8 px
patches, merged 2x2 by the projector; images scaled down to at most 64 px; weights drawn with std 0.05, not
0.02, see `INITIALIZER_RANGE`), the tokenizer (a fixed word list with Mistral's control tokens, built in code;
see `processor`) and the chat template (Mistral Small 3.1's, without its default system prompt).

Descriptor notes: the template renders ``[IMG]`` for an image (the processor's ``image_token``); its expansion
starts with ``[IMG]`` and ends with ``[IMG_END]``. The decoder is causal with 1-D positions and no sliding
window, so packed rows are exact.
"""

from vlmreg import FamilyDescriptor, LoraPreset, VisionTokens, hookimpl

# The whole model is initialised with the text config's range (Mistral3Config has none of its own). At the usual
# 0.02 the three 64-wide projector layers shrink image features to ~0.02 in norm, an eighth of a token
# embedding's (~0.16), and the tiny model barely sees the image; at 0.05 they are ~0.29 against ~0.39.
INITIALIZER_RANGE = 0.05


def tiny_config():
    """A tiny Mistral3Config of the real architecture; imported lazily so `vlmreg families` stays fast."""
    # deferred: start-up cost (loads transformers)
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig  # noqa: PLC0415

    # deferred: start-up cost (loads tokenizers, transformers)
    from vlmreg_tiny_pixtral import processor as p  # noqa: PLC0415

    return Mistral3Config(
        vision_config=PixtralVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=p.LONGEST_EDGE,
            patch_size=p.PATCH_SIZE,
        ),
        text_config=MistralConfig(
            vocab_size=p.VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=4096,
            sliding_window=None,
            pad_token_id=p.PAD_ID,
            bos_token_id=p.BOS_ID,
            eos_token_id=p.EOS_ID,
            initializer_range=INITIALIZER_RANGE,
        ),
        image_token_index=p.IMAGE_TOKEN_ID,
        spatial_merge_size=p.SPATIAL_MERGE_SIZE,
        vision_feature_layer=-1,
        multimodal_projector_bias=False,
        tie_word_embeddings=False,
    )


def tiny_processor():
    # deferred: start-up cost (loads tokenizers, transformers)
    from vlmreg_tiny_pixtral.processor import tiny_processor as build  # noqa: PLC0415

    return build()


LANGUAGE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROJECTOR = ("patch_merger.merging_layer", "multi_modal_projector.linear_1", "multi_modal_projector.linear_2")


@hookimpl
def vlmreg_register_families(register):
    register(
        FamilyDescriptor(
            name="mistral3",
            model_types=["mistral3"],
            vision_encoder_attr="model.vision_tower",
            language_model_attr="model.language_model",
            lm_head_attr="lm_head",
            connector_attrs=["model.multi_modal_projector"],
            vision_blocks_attr="transformer.layers",
            tiny_config=tiny_config,
            tiny_processor=tiny_processor,
            lora_presets={
                "language": LoraPreset(modules=LANGUAGE, description="attention and MLP projections of the decoder"),
                "language+projector": LoraPreset(
                    modules=(*LANGUAGE, *PROJECTOR),
                    scopes=("language_model", "connectors"),
                    description="the decoder's projections and the projector's patch merger and two linear layers",
                ),
                "all-linear": LoraPreset(
                    modules=("all-linear",),
                    scopes=("language_model", "vision_encoder", "connectors"),
                    description="every linear layer: decoder, Pixtral tower and projector",
                ),
            },
            max_images_per_message=8,
            vision_tokens=VisionTokens(image="[IMG]", end="[IMG_END]"),
            turn_end_tokens=("</s>",),
            packing=True,
            transformers_range=">=5.17,<6",
            description="Mistral 3: Pixtral ViT at native image sizes, patch-merging projector, Mistral decoder.",
        )
    )
