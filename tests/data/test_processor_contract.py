"""A processor outside vlmreg's processor contract gets a clear error, not "unexpected ... please report it" (issue 31
item 1): transformers' own PaliGemmaProcessor, built tiny and offline, refuses text without images, and returns
``labels`` (a training target) beside the model's inputs.
"""

from __future__ import annotations

import pytest
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PaliGemmaProcessor, PreTrainedTokenizerFast
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from vlmreg import FamilyDescriptor, hookimpl
from vlmreg.cli import main
from vlmreg.data import ImageStore
from vlmreg.data.prompts import ProcessorContractError, PromptEncoder
from vlmreg.scaffold import tiny_config_spec

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]
WORDS = ["user", "model", ":", "what", "colour", "is", "the", "shape", "?", "red", "green", "blue"]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }} {% endif %}{% endfor %}"
    "{% endif %}<eos> {% endfor %}{% if add_generation_prompt %}model : {% endif %}"
)


def paligemma_processor():
    """A real `PaliGemmaProcessor`: a word-level tokenizer and SigLIP's PIL image processor (32x32, 16 image tokens)."""

    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(SPECIAL + WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>"},
    )
    image_processor = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    image_processor.image_seq_length = 16
    return PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=TEMPLATE)


def refusal(processor) -> str:
    """The processor's own error for text alone: the reference the message must carry."""
    with pytest.raises(Exception) as info:
        processor(text=["a"], return_tensors="pt")
    return str(info.value)


def test_text_the_processor_refuses_without_images_is_a_contract_error():
    processor = paligemma_processor()
    store = ImageStore()
    image = store.add(Image.new("RGB", (32, 32), "red"))
    with pytest.raises(ProcessorContractError) as info:
        PromptEncoder(processor, store).encode(
            [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": image}, {"type": "text", "text": "what colour ?"}],
                }
            ]
        )
    message = str(info.value)
    assert message.startswith("the processor (PaliGemmaProcessor) refuses text without images (ValueError: ")
    assert refusal(processor) in message and "The processor contract" in message
    assert "the descriptor field prefix_lm lifts it" in message  # the requirement names the field that lifts it


def test_labels_are_a_training_target_never_an_input():
    processor = paligemma_processor()
    image = Image.new("RGB", (32, 32), "red")
    own = processor(text=["<image>"], images=[image], add_special_tokens=False, return_tensors="pt")
    assert own["labels"].shape == own["input_ids"].shape  # shaped like a token-aligned input
    store = ImageStore()
    features = store.features(store.add(image), processor, "<image>")
    assert set(features.token_inputs) == {"token_type_ids"} and set(features.tensors) == {"pixel_values"}


class PaliGemmaPlugin:
    @staticmethod
    @hookimpl
    def vlmreg_register_families(register):
        register(
            FamilyDescriptor(
                name="x_paligemma",
                model_types=["paligemma"],
                vision_encoder_attr="model.vision_tower",
                language_model_attr="model.language_model",
                lm_head_attr="lm_head",
                tiny_config=lambda: tiny_config_spec("paligemma").build(),
                tiny_processor=paligemma_processor,
                image_placeholder="<image>",
                turn_end_tokens=["<eos>"],
            )
        )


def test_the_cli_says_which_requirement_fails(vlmreg_add_plugin, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VLMREG_PLUGINS", "vlmreg-qwen3-vl")  # not the bundled paligemma, which claims its model type
    vlmreg_add_plugin(PaliGemmaPlugin(), "x_paligemma")
    config = tmp_path / "run.toml"
    config.write_text('[model]\ninit = "random"\nfamily = "x_paligemma"\n\n[data]\ntask = "colour"\nnum_samples = 2\n')
    assert main(["data", "preview", str(config)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: family x_paligemma: its processor (PaliGemmaProcessor) refuses text without images")
    assert "unexpected" not in err and "please report it" not in err
