"""Strict resolution against real tiny models: each bad path, prefix or LoRA pattern is an immediate, clear error."""

from __future__ import annotations

import attrs
import peft
import pytest
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import vlmreg
from vlmreg import LoraPreset, ResolutionError, UnknownFamilyError, resolve
from vlmreg.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_vl")


@pytest.fixture(scope="module")
def descriptor():
    return vlmreg.get_family("qwen3_vl")


def test_resolve_returns_the_real_modules(model):
    r = resolve(model)
    assert r.name == "qwen3_vl"
    assert r.vision_encoder is model.model.visual
    assert r.language_model is model.model.language_model
    assert r.layers is model.model.language_model.layers
    assert r.lm_head is model.lm_head
    assert r.vision_blocks is model.model.visual.blocks
    assert r.connectors == {
        "model.visual.merger": model.model.visual.merger,
        "model.visual.deepstack_merger_list": model.model.visual.deepstack_merger_list,
    }
    assert r.weight_prefix == "model.language_model.layers."
    assert r.lora_presets["language"].modules[0] == "model.language_model.layers.0.self_attn.q_proj"
    assert not r.lora_presets["language"].reaches_vision and r.lora_presets["all-linear"].reaches_vision


def test_resolution_error_is_a_value_error():
    assert issubclass(ResolutionError, ValueError) and issubclass(UnknownFamilyError, ResolutionError)


def test_a_path_that_does_not_resolve_names_the_step_and_the_candidates(model):
    with pytest.raises(ResolutionError) as info:
        resolve(model, {"language_model_attr": "model.language"})
    message = str(info.value)
    assert "language_model_attr = 'model.language' does not resolve" in message
    assert "model (Qwen3VLModel) has no submodule 'language'" in message
    assert "Did you mean 'language_model'" in message
    assert "its children: visual, language_model" in message


def test_a_property_is_not_a_submodule(model, descriptor):
    bad = attrs.evolve(descriptor, lm_head_attr="model.config")
    with pytest.raises(
        ResolutionError,
        match="no submodule 'config' \\('config' exists as a Qwen3VLConfig attribute, not a registered submodule\\)",
    ):
        resolve(model, family=bad)


def test_a_bad_vision_path_in_a_descriptor_fails_at_once(model, descriptor):
    bad = attrs.evolve(descriptor, vision_encoder_attr="visual")
    with pytest.raises(
        ResolutionError,
        match="vision_encoder_attr = 'visual' does not resolve: the model .* its children: model, lm_head",
    ):
        resolve(model, family=bad)


def test_a_bad_connector_fails(model):
    with pytest.raises(ResolutionError, match="connector_attrs = 'model.visual.mergr'.*Did you mean 'merger'"):
        resolve(model, {"connector_attrs": ["model.visual.mergr"]})


def test_layers_must_exist_under_the_language_model(model):
    with pytest.raises(
        ResolutionError,
        match="'model.visual.layers' does not resolve.*no submodule 'layers'.*its children: patch_embed",
    ):
        resolve(model, {"language_model_attr": "model.visual"})


def test_vision_blocks_must_be_a_module_list(model):
    with pytest.raises(ResolutionError, match="model.visual.merger is a Qwen3VLVisionPatchMerger, not a ModuleList"):
        resolve(model, {"vision_blocks_attr": "merger"})


def test_overrides_are_checked_and_used_everywhere(model):
    with pytest.raises(
        ResolutionError, match="Unknown override 'language_model_path'. Did you mean 'language_model_attr'"
    ):
        resolve(model, {"language_model_path": "model.language_model"})
    with pytest.raises(ResolutionError, match="override: FamilyDescriptor 'qwen3_vl': field 'lm_head_attr'"):
        resolve(model, {"lm_head_attr": "lm head"})
    r = resolve(model, {"connector_attrs": ["model.visual.merger"]})
    assert list(r.connectors) == ["model.visual.merger"] and r.overrides == {"connector_attrs": ["model.visual.merger"]}
    assert r.descriptor.connector_attrs == ("model.visual.merger",)


def test_an_override_moves_the_derived_weight_prefix(descriptor):
    class Renamed(nn.Module):  # the same model with its language model one level deeper
        def __init__(self, inner):
            super().__init__()
            self.config = inner.config
            self.model = nn.Module()
            self.model.visual = inner.model.visual
            self.model.text = nn.Module()
            self.model.text.decoder = inner.model.language_model
            self.lm_head = inner.lm_head

    model = Renamed(tiny_model("qwen3_vl"))
    with pytest.raises(ResolutionError, match="no submodule 'language_model'.*its children: visual, text"):
        resolve(model)
    r = resolve(model, {"language_model_attr": "model.text.decoder"})
    assert r.weight_prefix == "model.text.decoder.layers."
    assert r.lora_presets["language"].modules[0].startswith("model.text.decoder.layers.0.")


def test_unknown_model_type_lists_families_and_suggests():
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    with pytest.raises(UnknownFamilyError) as info:
        resolve(model)
    message = str(info.value)
    assert "No installed family claims model_type 'llama'" in message
    assert "qwen3_vl (qwen3_vl)" in message and "Install a plugin that registers it" in message


def test_did_you_mean_for_a_near_model_type(model, descriptor):
    with pytest.raises(UnknownFamilyError, match="Did you mean 'qwen3_vl'"):
        vlmreg.get_registry().for_model_type("qwen3-vl")


def test_an_explicit_family_must_claim_the_model_type(model):
    with pytest.raises(
        ResolutionError,
        match="family 'qwen3_5' claims model_types qwen3_5, but the model's config.model_type is 'qwen3_vl'",
    ):
        resolve(model, family="qwen3_5")


def test_a_lora_pattern_that_matches_nothing_is_an_error(model, descriptor):
    presets = {**descriptor.lora_presets, "language": LoraPreset(modules=("q_proj", "qkv_proj"))}
    with pytest.raises(
        ResolutionError,
        match="LoRA target 'language': 'qkv_proj' matches nothing under model.language_model. peft would skip it "
        "silently",
    ):
        resolve(model, family=attrs.evolve(descriptor, lora_presets=presets))


def test_a_lora_pattern_on_a_container_module_is_an_error(model):
    with pytest.raises(
        ResolutionError,
        match="pattern 'mlp' matches 'model.language_model.layers.0.mlp' \\(Qwen3VLTextMLP\\), which peft cannot adapt",
    ):
        resolve(model).lora_targets(["mlp"])


def test_lora_targets_for_explicit_lists_scopes_and_excludes(model):
    r = resolve(model)
    assert r.lora_targets() is r.lora_presets["language"]
    only_q = r.lora_targets(["q_proj"])
    assert only_q.modules == (
        "model.language_model.layers.0.self_attn.q_proj",
        "model.language_model.layers.1.self_attn.q_proj",
    )
    vision_qkv = r.lora_targets(["qkv"], scopes=["vision_encoder"])
    assert len(vision_qkv.modules) == 2 and vision_qkv.reaches_vision
    trimmed = r.lora_targets("language", exclude=["layers.1.self_attn.q_proj"])
    assert "model.language_model.layers.1.self_attn.q_proj" not in trimmed.modules
    assert len(trimmed.modules) == len(r.lora_presets["language"].modules) - 1
    projector = r.lora_targets("language+projector")
    assert not projector.reaches_vision and "model.visual.merger.linear_fc1" in projector.modules
    with pytest.raises(ResolutionError, match="LoRA exclude pattern 'nothing' matches no target"):
        r.lora_targets("language", exclude=["nothing"])
    with pytest.raises(ResolutionError, match="Unknown LoRA preset 'langauge'.*Did you mean 'language'"):
        r.lora_targets("langauge")
    with pytest.raises(
        ResolutionError,
        match="scope 'connectors', but the family resolves no module for it; set the descriptor's connector_attrs",
    ):
        resolve(model, {"connector_attrs": []}).lora_targets(["linear_fc1"], scopes=["connectors"])


def test_lm_head_is_never_a_lora_target(model):
    r = resolve(model)
    assert not any(m.startswith("lm_head") for t in r.lora_presets.values() for m in t.modules)


def test_moe_expert_parameters_are_targets():
    r = resolve(tiny_model("qwen3_vl_moe"))
    experts = r.lora_presets["language+experts"]
    assert experts.parameters == (
        "model.language_model.layers.0.mlp.experts.gate_up_proj",
        "model.language_model.layers.0.mlp.experts.down_proj",
        "model.language_model.layers.1.mlp.experts.gate_up_proj",
        "model.language_model.layers.1.mlp.experts.down_proj",
    )
    assert experts.peft_kwargs()["target_parameters"] == list(experts.parameters)


def test_a_peft_wrapped_model_resolves_to_the_same_modules():
    model = tiny_model("qwen3_vl")
    targets = resolve(model).lora_presets["language"]
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, **targets.peft_kwargs()))
    r = resolve(wrapped)
    assert r.model is model and r.weight_prefix == "model.language_model.layers."


def test_resolve_needs_a_transformers_model():
    with pytest.raises(ResolutionError, match="Linear has no config.model_type"):
        resolve(nn.Linear(2, 2))
