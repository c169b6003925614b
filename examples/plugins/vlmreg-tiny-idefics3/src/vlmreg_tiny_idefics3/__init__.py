"""Idefics3 (SmolVLM's architecture: a SigLIP-style vision encoder, a pixel-shuffle connector and a Llama decoder) as a
vlmreg family.

What is real: the architecture class (``Idefics3ForConditionalGeneration``, model_type ``idefics3``, which the
SmolVLM checkpoints use), the processor class (``Idefics3Processor`` with the PIL ``Idefics3ImageProcessorPil``),
image splitting into tiles plus a global view with SmolVLM's layout tokens (``<fake_token_around_image>``,
``<row_i_col_j>``, ``<global-img>``), and SmolVLM-Instruct's chat template (turns end with ``<end_of_utterance>``).

What is tiny and offline: the config (2 Llama layers of hidden size 64; a 2-layer vision encoder on 32x32 tiles
in 8x8 patches, pixel-shuffled by 2 to 4 ``<image>`` tokens a tile) and the tokenizer (a fixed word list with
SmolVLM's special tokens, built in code; see `processor`). Images are resized to a 64 px longest edge and cut
into 32 px tiles, so a square image is 2x2 tiles and a global view (34 tokens with the layout tokens).

Descriptor notes: the template renders ``<image>`` for an image (the processor's ``image_token``, so no
``image_placeholder`` is needed); its expansion starts and ends at ``<fake_token_around_image>``. The decoder
is plain causal Llama with 1-D positions, so packed rows are exact. vlmreg collates image tensors per image,
``(images, most tiles, ...)`` zero-padded, where the processor gives a prompt's tiles in one row,
``(1, all tiles, ...)``: ``processor_layout`` declares that mapping, and ``vlmreg check`` compares through it.
"""

from vlmreg import FamilyDescriptor, LoraPreset, VisionTokens, hookimpl


def tiny_config():
    """A tiny Idefics3Config of the real architecture; imported lazily so `vlmreg families` stays fast."""
    # deferred: start-up cost (loads transformers)
    from transformers import Idefics3Config, LlamaConfig  # noqa: PLC0415
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig  # noqa: PLC0415

    # deferred: start-up cost (loads tokenizers, transformers)
    from vlmreg_tiny_idefics3 import processor as p  # noqa: PLC0415

    return Idefics3Config(
        vision_config=Idefics3VisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=p.TILE_SIZE,
            patch_size=p.PATCH_SIZE,
        ),
        text_config=LlamaConfig(
            vocab_size=p.VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=4096,
            pad_token_id=p.PAD_ID,
            bos_token_id=p.BOS_ID,
            eos_token_id=p.EOS_ID,
        ),
        image_token_id=p.IMAGE_TOKEN_ID,
        scale_factor=p.SCALE_FACTOR,
        pad_token_id=p.PAD_ID,
    )


def tiny_processor():
    # deferred: start-up cost (loads tokenizers, transformers)
    from vlmreg_tiny_idefics3.processor import tiny_processor as build  # noqa: PLC0415

    return build()


def processor_layout(collated):
    """One prompt's tiles in the processor's layout: flatten (images, tiles) and drop the all-zero padding tiles, the
    rule ``Idefics3Model.get_image_features`` applies itself, so the model reads both layouts alike."""
    pixels, mask = collated["pixel_values"], collated["pixel_attention_mask"]
    tiles = pixels.flatten(0, 1)
    real = tiles.flatten(1).ne(0).any(1)
    return {"pixel_values": tiles[real][None], "pixel_attention_mask": mask.flatten(0, 1)[real][None]}


LANGUAGE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@hookimpl
def vlmreg_register_families(register):
    register(
        FamilyDescriptor(
            name="idefics3",
            model_types=["idefics3"],
            vision_encoder_attr="model.vision_model",
            language_model_attr="model.text_model",
            lm_head_attr="lm_head",
            connector_attrs=["model.connector"],
            vision_blocks_attr="encoder.layers",
            tiny_config=tiny_config,
            tiny_processor=tiny_processor,
            lora_presets={
                "language": LoraPreset(modules=LANGUAGE, description="attention and MLP projections of the decoder"),
                "language+projector": LoraPreset(
                    modules=(*LANGUAGE, "modality_projection.proj"),
                    scopes=("language_model", "connectors"),
                    description="the decoder's projections and the connector's linear layer",
                ),
                "all-linear": LoraPreset(
                    modules=("all-linear",),
                    scopes=("language_model", "vision_encoder", "connectors"),
                    description="every linear layer: decoder, vision encoder and connector",
                ),
            },
            max_images_per_message=8,
            vision_tokens=VisionTokens(image="<image>", start="<fake_token_around_image>"),
            turn_end_tokens=("<end_of_utterance>",),
            processor_layout=processor_layout,
            packing=True,
            transformers_range=">=5.17,<6",
            description="Idefics3 / SmolVLM: SigLIP-style ViT on image tiles, pixel-shuffle connector, Llama decoder.",
        )
    )
