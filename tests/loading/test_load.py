"""vlmreg.load: each bundled family's tiny model and processor, offline, with and without LoRA; local checkpoints."""

from __future__ import annotations

import attrs
import pytest
import torch
from transformers import AutoTokenizer

import vlmreg
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.loading.load import load_processor
from vlmreg.sdk.errors import ResolutionError, VlmregError

FAMILIES = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]


def random_config(family: str, **model):
    return parse_config({"model": {"init": "random", "family": family, **model}, "trainer": {"device": "cpu"}})


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_and_processor_load_offline(family):
    loaded = vlmreg.load(random_config(family))
    assert loaded.resolved.name == family and loaded.lora is None
    assert loaded.device.type == "cpu" and loaded.dtype == torch.float32
    assert next(loaded.model.parameters()).dtype == torch.float32
    vision = loaded.resolved.vision_encoder
    connector_ids = {id(p) for m in loaded.resolved.connectors.values() for p in m.parameters()}
    assert all(not p.requires_grad for p in vision.parameters() if id(p) not in connector_ids)
    assert all(p.requires_grad for m in loaded.resolved.connectors.values() for p in m.parameters())
    assert all(p.requires_grad for p in loaded.resolved.language_model.parameters())
    assert loaded.frozen_parameters > 0
    text = loaded.processor.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("assistant\n") or "assistant" in text


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_loads_with_lora_and_reports_its_adapters(family):
    loaded = vlmreg.load(random_config(family, lora={"r": 4}))
    report = loaded.lora
    assert report.targets == "language" and report.modules
    assert report.modules == loaded.resolved.lora_presets["language"].modules
    trainable = {n for n, p in loaded.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert report.trainable_parameters == sum(p.numel() for p in loaded.model.parameters() if p.requires_grad)


def test_lora_on_the_vision_tower_when_unfrozen():
    loaded = vlmreg.load(
        random_config(
            "qwen3_vl", lora={"targets": ["qkv"], "scopes": ["vision_encoder"]}, vlm={"freeze_vision_encoder": False}
        )
    )
    assert loaded.lora.modules == ("model.visual.blocks.0.attn.qkv", "model.visual.blocks.1.attn.qkv")


def test_lora_regex_and_exclude():
    loaded = vlmreg.load(random_config("qwen3_vl", lora={"targets": "re:.*\\.layers\\.0\\.self_attn\\.(q|v)_proj"}))
    assert loaded.lora.modules == (
        "model.language_model.layers.0.self_attn.q_proj",
        "model.language_model.layers.0.self_attn.v_proj",
    )
    loaded = vlmreg.load(
        random_config("qwen3_vl", lora={"targets": ["q_proj", "v_proj"], "exclude": ["layers.1.self_attn.v_proj"]})
    )
    assert "model.language_model.layers.1.self_attn.v_proj" not in loaded.lora.modules and len(loaded.lora.modules) == 3


def test_lora_target_matching_nothing_fails_before_peft():
    with pytest.raises(
        ResolutionError, match="'qkv_proj' matches nothing under model.language_model. peft would skip it silently"
    ):
        vlmreg.load(random_config("qwen3_vl", lora={"targets": ["q_proj", "qkv_proj"]}))


def test_moe_experts_are_adapted_through_target_parameters():
    loaded = vlmreg.load(random_config("qwen3_5_moe", lora={"targets": "language+experts"}))
    assert loaded.lora.parameters[0] == "model.language_model.layers.0.mlp.experts.gate_up_proj"


def test_overrides_resolve_strictly():
    with pytest.raises(
        ResolutionError,
        match="language_model_attr = 'model.languagemodel' does not resolve.*Did you mean 'language_model'",
    ):
        vlmreg.load(random_config("qwen3_vl", vlm={"language_model_attr": "model.languagemodel"}))
    loaded = vlmreg.load(random_config("qwen3_vl", vlm={"connector_attrs": ["model.visual.merger"]}))
    assert list(loaded.resolved.connectors) == ["model.visual.merger"]


def test_freeze_connectors_too():
    loaded = vlmreg.load(random_config("qwen3_vl", vlm={"freeze_connectors": True}))
    assert not any(p.requires_grad for p in loaded.resolved.vision_encoder.parameters())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3.5 checkpoint saved as a real one: safetensors weights, config, processor files."""
    loaded = vlmreg.load(random_config("qwen3_5"))
    directory = tmp_path_factory.mktemp("Qwen3.5-Tiny")
    loaded.model.save_pretrained(directory)
    loaded.processor.save_pretrained(directory)
    return directory, loaded.model


def test_a_local_safetensors_checkpoint_loads_with_its_processor(checkpoint):
    directory, original = checkpoint
    loaded = vlmreg.load(parse_config({"model": {"name": str(directory)}, "trainer": {"device": "cpu"}}))
    assert loaded.config.family.name == "qwen3_5" and loaded.config.checkpoint_dir == directory
    for (name, a), (_, b) in zip(original.state_dict().items(), loaded.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert type(loaded.processor).__name__ == "TinyQwenProcessor" and loaded.processor.image_processor is not None


def test_pickle_weights_are_refused(tmp_path, checkpoint):
    directory, _ = checkpoint
    for file in directory.iterdir():  # everything but the safetensors weights
        if file.suffix != ".safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(
        VlmregError, match="no \\*.safetensors weights \\(found pytorch_model.bin: pickle files are never loaded\\)"
    ):
        vlmreg.load(parse_config({"model": {"name": str(tmp_path)}, "trainer": {"device": "cpu"}}))


def test_a_processor_without_an_image_processor_is_refused(tmp_path, checkpoint, monkeypatch):
    directory, _ = checkpoint

    rc = resolve_config(parse_config({"model": {"name": str(directory)}}))

    bare = attrs.evolve(rc, family=attrs.evolve(rc.family, load_processor=lambda d: AutoTokenizer.from_pretrained(d)))
    with pytest.raises(VlmregError, match="without an image processor"):
        load_processor(bare)


def test_model_layers_keeps_the_shapes_first_layers():
    """``model.layers``: the shape's first N decoder layers, every other dimension the shape's."""
    whole, cut = vlmreg.load(random_config("qwen3_vl_moe")), vlmreg.load(random_config("qwen3_vl_moe", layers=1))
    assert len(cut.resolved.layers) == 1 and len(whole.resolved.layers) == 2
    sizes = {n: p.shape for n, p in whole.model.named_parameters() if ".layers.1." not in n}
    assert {n: p.shape for n, p in cut.model.named_parameters()} == sizes
    with pytest.raises(VlmregError, match="qwen3_vl_moe tiny: layers = 3, but the shape has 2 decoder layers"):
        vlmreg.load(random_config("qwen3_vl_moe", layers=3))
    with pytest.raises(VlmregError, match="layers"):
        parse_config({"model": {"name": "some/checkpoint", "layers": 3}})
