"""LLaVA (a CLIP vision tower, a two-layer projector and a Llama language model) as a vlmreg family."""

from vlmreg import FamilyDescriptor, LoraPreset, hookimpl


def tiny_config():
    """A tiny LlavaConfig of the real architecture; imported lazily so `vlmreg families` stays fast."""
    # deferred: start-up cost (loads transformers)
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig  # noqa: PLC0415

    # deferred: start-up cost (loads tokenizers, transformers)
    from vlmreg_tiny_llava.processor import IMAGE_TOKEN_ID, VOCAB_SIZE  # noqa: PLC0415

    return LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        text_config=LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        ),
        image_token_index=IMAGE_TOKEN_ID,
    )


def tiny_processor():
    # deferred: start-up cost (loads tokenizers, transformers)
    from vlmreg_tiny_llava.processor import tiny_processor as build  # noqa: PLC0415

    return build()


LANGUAGE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@hookimpl
def vlmreg_register_families(register):
    register(
        FamilyDescriptor(
            name="llava",
            model_types=["llava"],
            vision_encoder_attr="model.vision_tower",
            language_model_attr="model.language_model",
            lm_head_attr="lm_head",
            connector_attrs=["model.multi_modal_projector"],
            vision_blocks_attr="encoder.layers",
            tiny_config=tiny_config,
            tiny_processor=tiny_processor,
            lora_presets={
                "language": LoraPreset(modules=LANGUAGE),
                "language+projector": LoraPreset(
                    modules=(*LANGUAGE, "linear_1", "linear_2"), scopes=("language_model", "connectors")
                ),
                "all-linear": LoraPreset(
                    modules=("all-linear",), scopes=("language_model", "vision_encoder", "connectors")
                ),
            },
            max_images_per_message=1,
            transformers_range=">=5.17,<6",
            description="LLaVA 1.5 layout: CLIP ViT, MLP projector, Llama decoder.",
        )
    )
