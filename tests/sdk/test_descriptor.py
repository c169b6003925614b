"""FamilyDescriptor: defaults, derived values, and a clear error for every bad field."""

from __future__ import annotations

import json

import attrs
import pytest

from vlmreg import ALL_LINEAR, DescriptorError, FamilyDescriptor, LoraPreset, ThinkingMode, VisionTokens


def _config():  # a tiny_config stand-in: never called by the descriptor itself
    raise AssertionError("descriptors must not call tiny_config")


REQUIRED = dict(
    name="toy",
    model_types=["toy_vl"],
    vision_encoder_attr="model.vision",
    language_model_attr="model.text",
    lm_head_attr="lm_head",
    tiny_config=_config,
)


def make(**changes):
    return FamilyDescriptor(**{**REQUIRED, **changes})


def test_required_fields_are_enough_and_defaults_are_sensible():
    d = make()
    assert d.model_types == ("toy_vl",)
    assert d.weight_prefix == "model.text.layers."
    assert d.default_lora_preset == "language"
    assert set(d.lora_presets) == {"language", "all-linear"}
    assert d.lora_presets["all-linear"].modules == (ALL_LINEAR,)
    assert d.lora_presets["all-linear"].scopes == ("language_model", "vision_encoder")
    assert make(connector_attrs=["model.projector"]).lora_presets["all-linear"].scopes[-1] == "connectors"
    assert d.supports_vision and d.max_images_per_message == 1
    assert d.thinking_modes == () and d.connector_attrs == ()


def test_weight_prefix_follows_language_model_attr():
    assert make(language_model_attr="backbone.lm").weight_prefix == "backbone.lm.layers."


def test_descriptor_is_frozen_and_its_mappings_are_read_only():
    d = make()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        d.name = "other"
    with pytest.raises(TypeError):
        d.lora_presets["x"] = LoraPreset(modules=("q_proj",))


def test_fields_are_keyword_only():
    with pytest.raises(TypeError):
        FamilyDescriptor("toy", ["toy_vl"], "a", "b", "c", _config)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("name", "Has Space", "field 'name' must be a lower-case name"),
        ("name", "", "field 'name'"),
        ("model_types", "toy_vl", "field 'model_types' must be a list of model_type names"),
        ("model_types", [], "must list at least one model_type name"),
        ("model_types", ["a", "a"], "lists 'a' more than once"),
        ("vision_encoder_attr", "model..vision", "field 'vision_encoder_attr' must be a dotted attribute path"),
        ("language_model_attr", "model/text", "field 'language_model_attr'"),
        ("lm_head_attr", 3, "field 'lm_head_attr'"),
        ("tiny_config", {"hidden": 1}, "field 'tiny_config' must be a zero-argument callable"),
        ("connector_attrs", ["ok.path", "bad path"], "field 'connector_attrs'"),
        ("max_images_per_message", -1, "field 'max_images_per_message' must be an int >= 0 (got -1)"),
        ("max_images_per_message", True, "field 'max_images_per_message'"),
        ("supports_vision", "yes", "field 'supports_vision' must be True or False"),
        ("lora_presets", {"language": "q_proj"}, "field 'lora_presets' must be a mapping"),
        ("lora_presets", {"Bad Name": LoraPreset(modules=("q_proj",))}, "field 'lora_presets'"),
        ("default_lora_preset", "nope", "field 'default_lora_preset' names 'nope', which is not in lora_presets"),
        (
            "thinking_modes",
            [ThinkingMode("on"), ThinkingMode("on")],
            "field 'thinking_modes' names a mode more than once",
        ),
        ("thinking_modes", ["on"], "field 'thinking_modes' must be a list of ThinkingMode"),
        ("default_thinking_mode", "on", "field 'default_thinking_mode' names 'on', which is not in thinking_modes"),
        ("default_thinking_budget", 0, "field 'default_thinking_budget' must be None or an int >= 1"),
        ("vision_processor_id", "", "field 'vision_processor_id' must be None or a non-empty string"),
        ("vision_processor_ids", {"*": 3}, "field 'vision_processor_ids'"),
        ("transformers_range", "five", "field 'transformers_range' must be a version specifier"),
        ("model_class", "transformers.Foo", "field 'model_class' must be None or an import path"),
        ("tiny_processor", "proc", "field 'tiny_processor'"),
        ("vision_blocks_attr", "model.vision.blocks", "field 'vision_blocks_attr' is relative to vision_encoder_attr"),
        ("vision_tokens", {"image": "<image>"}, "field 'vision_tokens' must be None or a VisionTokens"),
        ("description", None, "field 'description' must be a string"),
    ],
)
def test_bad_field_values_raise_naming_the_family_and_field(field, value, expected):
    with pytest.raises(DescriptorError) as info:
        make(**{field: value})
    assert expected in str(info.value)
    assert str(info.value).startswith("FamilyDescriptor 'toy': " if field != "name" else "FamilyDescriptor ")


def test_vision_free_family_must_not_accept_images():
    with pytest.raises(DescriptorError, match="max_images_per_message' must be 0 when supports_vision is False"):
        make(supports_vision=False)
    assert make(supports_vision=False, max_images_per_message=0).max_images_per_message == 0


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(modules=()), "both empty"),
        (
            dict(modules=("q_proj",), scopes=("vision",)),
            "field 'scopes' may only name language_model, vision_encoder, connectors",
        ),
        (dict(modules=("q proj",)), "field 'modules'"),
        (dict(modules=("q_proj",), scopes=()), "field 'scopes' must list at least one scope"),
        (dict(parameters=("experts.",)), "field 'parameters'"),
    ],
)
def test_bad_lora_presets(kwargs, expected):
    with pytest.raises(DescriptorError, match=expected):
        LoraPreset(**kwargs)


def test_lora_preset_knows_when_it_reaches_vision():
    assert not LoraPreset(modules=("q_proj",)).reaches_vision
    assert LoraPreset(modules=(ALL_LINEAR,), scopes=("language_model", "vision_encoder")).reaches_vision


def test_thinking_modes_per_checkpoint_with_exclusions():
    d = make(
        thinking_modes=[
            ThinkingMode("off", checkpoints=("*", "!*-Thinking*")),
            ThinkingMode("on", checkpoints=("*-Thinking*",)),
        ],
        default_thinking_mode="off",
    )
    assert [m.name for m in d.thinking_modes_for("Qwen/Qwen3-VL-2B-Thinking")] == ["on"]
    assert [m.name for m in d.thinking_modes_for("/ckpt/Qwen3-VL-2B-Instruct")] == ["off"]
    assert [m.name for m in d.thinking_modes_for(None)] == ["off"]


def test_thinking_mode_kwargs_are_read_only():
    mode = ThinkingMode("off", {"enable_thinking": False})
    assert dict(mode.chat_template_kwargs) == {"enable_thinking": False}
    with pytest.raises(TypeError):
        mode.chat_template_kwargs["enable_thinking"] = True


def test_processor_id_per_checkpoint_falls_back_to_default():
    d = make(vision_processor_id="org/base", vision_processor_ids={"*-Thinking*": "org/thinking"})
    assert d.processor_id_for("/models/Toy-2B-Thinking/") == "org/thinking"
    assert d.processor_id_for("org/Toy-2B") == "org/base"
    assert d.processor_id_for(None) == "org/base"


def test_summary_is_json_ready_and_carries_the_derived_prefix():
    d = make(vision_tokens=VisionTokens(image="<image>"), thinking_modes=[ThinkingMode("on", {"think": True})])
    data = json.loads(json.dumps(d.summary()))
    assert data["weight_prefix"] == "model.text.layers."
    assert data["vision_tokens"]["image"] == "<image>"
    assert data["thinking_modes"][0]["chat_template_kwargs"] == {"think": True}


def test_the_data_path_fields_default_to_the_processor_and_tokenizer():
    d = make()
    assert d.layers_attr == "layers" and d.layers_path == "model.text.layers"
    assert d.image_placeholder is None and d.turn_end_tokens == () and d.thinking_end is None
    assert d.collate_images is None and d.processor_layout is None and d.packing is True and d.prefix_lm is None
    assert make(prefix_lm="token_type_ids", packing=False).summary()["prefix_lm"] == "token_type_ids"
    assert d.lora_presets["language"].modules == (ALL_LINEAR,) and d.lora_presets["language"].scopes == (
        "language_model",
    )
    assert make(layers_attr="decoder.h").weight_prefix == "model.text.decoder.h."
    summary = make(turn_end_tokens=["<end_of_turn>"], packing=False).summary()
    assert (
        summary["turn_end_tokens"] == ["<end_of_turn>"]
        and summary["packing"] is False
        and summary["layers_attr"] == "layers"
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layers_attr": "model.text.layers"}, "field 'layers_attr' is relative to language_model_attr"),
        ({"layers_attr": "la yers"}, "field 'layers_attr' must be a dotted attribute path"),
        ({"turn_end_tokens": "<end_of_turn>"}, "field 'turn_end_tokens' must be a list of token strings"),
        ({"turn_end_tokens": ["<a>", "<a>"]}, "field 'turn_end_tokens' lists '<a>' more than once"),
        ({"image_placeholder": ""}, "field 'image_placeholder' must be None or a non-empty string"),
        ({"thinking_end": 3}, "field 'thinking_end' must be None or a non-empty string"),
        (
            {"collate_images": "concat"},
            "field 'collate_images' must be a callable taking the images' list of input dicts or None",
        ),
        (
            {"processor_layout": {"pixel_values": "flat"}},
            "field 'processor_layout' must be a callable taking one prompt's collated image tensors or None",
        ),
        ({"packing": "yes"}, "field 'packing' must be True or False"),
        ({"prefix_lm": True}, "field 'prefix_lm' must be None or a non-empty string"),
        (
            {"prefix_lm": "token_type_ids"},
            "field 'prefix_lm' needs packing=False: a packed row attends causally within each sample",
        ),
        (
            {"prefix_lm": "token_type_ids", "packing": False, "max_videos_per_message": 1, "video_placeholder": "<v>"},
            r"field 'prefix_lm' needs max_videos_per_message=0 \(got 1\): a prefix-LM prompt is its processor's own",
        ),
        ({"init_random_weights": 1}, "field 'init_random_weights' must be a callable taking the model or None"),
    ],
)
def test_bad_data_path_fields_name_the_field(changes, message):
    with pytest.raises(DescriptorError, match=message):
        make(**changes)
