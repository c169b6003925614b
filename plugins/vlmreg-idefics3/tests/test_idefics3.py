"""The bundled idefics3 family: the conformance suite, SmolVLM2's class under the same descriptor, the published
checkpoint layout on the wire, processors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import peft
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration
from transformers.models.smolvlm import processing_smolvlm

import vlmreg
from vlmreg.broadcast import WeightPlan, apply_weights
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import FamilyConformance, tiny_forward_inputs, tiny_model
from vlmreg.testing.weights import assert_same_state, loaded_back, sent_weights

FAMILY = "idefics3"


class TestIdefics3Conformance(FamilyConformance):
    family = FAMILY
    distribution = "vlmreg-idefics3"


def tiny_smolvlm(seed: int = 0) -> torch.nn.Module:
    """SmolVLM2's class (model_type smolvlm) with the tiny Idefics3 config's values."""

    values = {
        k: v
        for k, v in get_registry().get(FAMILY).tiny_config().to_dict().items()
        if k not in ("model_type", "transformers_version")
    }
    torch.manual_seed(seed)
    return SmolVLMForConditionalGeneration(SmolVLMConfig(**values)).eval()


def saved_by_transformers(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(directory)
    saved: dict[str, torch.Tensor] = {}
    for file in directory.glob("*.safetensors"):
        saved.update(load_file(file))
    return saved


@pytest.mark.parametrize("build", [lambda: tiny_model(FAMILY), tiny_smolvlm], ids=["idefics3", "smolvlm"])
def test_sent_tensors_are_what_save_pretrained_writes(build, tmp_path: Path):
    """SmolVLM checkpoints keep the in-memory layout: model.text_model.*, model.vision_model.*, model.connector.*,
    lm_head."""
    model = build()
    wire = sent_weights(model)
    assert_same_state(wire, saved_by_transformers(model, tmp_path))
    assert {
        "model.connector.modality_projection.proj.weight",
        "model.vision_model.post_layernorm.weight",
        "lm_head.weight",
    } <= set(wire)


@pytest.mark.parametrize("build", [lambda: tiny_model(FAMILY), tiny_smolvlm], ids=["idefics3", "smolvlm"])
def test_sent_tensors_load_back_through_transformers_to_identical_weights(build, tmp_path: Path):
    model = build()
    loaded = loaded_back(model, tmp_path)
    assert_same_state(loaded.state_dict(), model.state_dict())


def test_apply_weights_round_trip():
    source, target = vlmreg.resolve(tiny_model(FAMILY, seed=0)), vlmreg.resolve(tiny_model(FAMILY, seed=1))
    assert apply_weights(target, sent_weights(source.model)) == len(list(target.model.parameters()))
    assert_same_state(target.model.state_dict(), source.model.state_dict())


def test_smolvlm_resolves_with_the_same_descriptor_and_its_presets_reach_the_connector():
    resolved = vlmreg.resolve(tiny_smolvlm())
    assert resolved.name == FAMILY and len(resolved.layers) == 2
    assert list(resolved.connectors) == ["model.connector"]
    targets = resolved.lora_presets["language+projector"]
    assert "model.connector.modality_projection.proj" in set(targets.modules)


def test_smolvlm_forward_equals_idefics3_on_the_same_weights():
    idefics3, smolvlm = tiny_model(FAMILY), tiny_smolvlm()
    smolvlm.load_state_dict(idefics3.state_dict())
    inputs = tiny_forward_inputs(FAMILY)
    with torch.no_grad():
        assert torch.equal(idefics3(**inputs).logits, smolvlm(**inputs).logits)


def _checkpoint_processor_dir(directory: Path, processor_class: str, image_processor_type: str) -> Path:
    """The tiny processor saved the way real checkpoints ship theirs: preprocessor_config.json beside the rest."""
    get_registry().get(FAMILY).tiny_processor().save_pretrained(directory)
    config = json.loads((directory / "processor_config.json").read_text())
    image = config.pop("image_processor")
    (directory / "processor_config.json").write_text(json.dumps({**config, "processor_class": processor_class}))
    (directory / "preprocessor_config.json").write_text(
        json.dumps({**image, "image_processor_type": image_processor_type, "processor_class": processor_class})
    )
    return directory


def test_an_idefics3_checkpoint_s_processor_loads_without_torchvision(tmp_path: Path):
    directory = _checkpoint_processor_dir(tmp_path, "Idefics3Processor", "Idefics3ImageProcessor")
    processor = get_registry().get(FAMILY).load_processor(directory)
    assert type(processor).__name__ == "Idefics3Processor" and processor.image_processor is not None


def test_a_smolvlm2_checkpoint_s_processor_loads_without_a_video_processor(tmp_path: Path, monkeypatch):
    """SmolVLMProcessor needs torchvision for its video processor (left out) and num2words (stubbed here: vlmreg feeds
    images only, and the image expansion does not use it)."""

    monkeypatch.setattr(processing_smolvlm, "num2words", str)
    directory = _checkpoint_processor_dir(tmp_path, "SmolVLMProcessor", "SmolVLMImageProcessor")
    processor = get_registry().get(FAMILY).load_processor(directory)
    assert isinstance(processor, processing_smolvlm.SmolVLMProcessor) and processor.image_processor is not None
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the image ?"}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    ids = processor(text=[text], images=[[Image.new("RGB", (64, 64), "red")]], return_tensors="pt")["input_ids"]
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert int((ids == image_id).sum()) == 5 * 4  # 2x2 tiles and the global view, 4 tokens each


@pytest.mark.parametrize(
    ("checkpoint", "processor"),
    [
        ("HuggingFaceTB/SmolVLM-256M-Instruct", "HuggingFaceTB/SmolVLM-256M-Instruct"),
        ("/ckpts/SmolVLM-500M-Base", "HuggingFaceTB/SmolVLM-500M-Instruct"),
        ("HuggingFaceTB/SmolVLM2-256M-Video-Instruct", "HuggingFaceTB/SmolVLM2-256M-Video-Instruct"),
        ("HuggingFaceTB/SmolVLM2-2.2B-Instruct", "HuggingFaceTB/SmolVLM2-2.2B-Instruct"),
        ("HuggingFaceM4/Idefics3-8B-Llama3", "HuggingFaceM4/Idefics3-8B-Llama3"),
        ("runs/my-finetune", "HuggingFaceTB/SmolVLM-Instruct"),
    ],
)
def test_processor_ids_per_checkpoint(checkpoint: str, processor: str):
    assert get_registry().get(FAMILY).processor_id_for(checkpoint) == processor


def test_no_thinking_modes():
    descriptor = get_registry().get(FAMILY)
    assert descriptor.thinking_modes == () and descriptor.thinking_end is None


def test_lora_on_the_connector_sends_merged_weights_equal_to_peft_s_merge_and_unload():
    resolved = vlmreg.resolve(tiny_model(FAMILY))
    config = peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, **resolved.lora_targets("language+projector").peft_kwargs()
    )
    wrapped = peft.get_peft_model(resolved.model, config)
    plan = WeightPlan.from_resolved(vlmreg.resolve(wrapped), include_frozen_vision=True)
    assert "model.connector.modality_projection.proj.weight" in {w.name for w in plan.weights if w.adapters}
    merged = copy.deepcopy(wrapped).merge_and_unload()
    assert_same_state(dict(plan.tensors()), {n: p.detach() for n, p in merged.named_parameters()})
