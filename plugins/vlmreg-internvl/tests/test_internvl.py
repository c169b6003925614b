"""The bundled internvl family: the conformance suite, tiles per image, the published checkpoint layout on the wire,
processors."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import peft
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoProcessor, InternVLConfig, InternVLProcessor
from transformers.utils import is_torchvision_available
from vlmreg_internvl import processor as p

import vlmreg
from vlmreg.broadcast import WeightPlan, apply_weights
from vlmreg.loading.build import build_model
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import FamilyConformance, tiny_model
from vlmreg.testing.weights import assert_same_state, loaded_back, sent_weights

FAMILY = "internvl"


class TestInternVLConformance(FamilyConformance):
    family = FAMILY
    distribution = "vlmreg-internvl"


# --- images: tiles and tokens ------------------------------------------------------------------------------------


def test_each_image_gets_its_own_tile_count():
    """64x64: 2x2 tiles + thumbnail; 32x64 (portrait): 1x2 + 1; 96x32: 3x1 + 1; 32x32: one tile, no thumbnail.
    4 <IMG_CONTEXT> tokens a tile, each image between <img> and </img>, in one call with all four."""

    processor = get_registry().get(FAMILY).tiny_processor()
    sizes, tiles = [(64, 64), (32, 64), (96, 32), (32, 32)], [5, 3, 4, 1]
    content = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": "what colour is the image ?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    out = processor(text=[text], images=[[Image.new("RGB", s, "red") for s in sizes]], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    starts = [i for i, t in enumerate(ids) if t == processor.start_image_token_id]
    ends = [i for i, t in enumerate(ids) if t == processor.end_image_token_id]
    per_image = [sum(1 for t in ids[s:e] if t == processor.image_token_id) for s, e in zip(starts, ends, strict=True)]
    assert per_image == [4 * n for n in tiles]
    assert out["pixel_values"].shape == (sum(tiles), 3, 32, 32)


def test_the_tiny_tokenizer_asset():
    tokenizer = p.tiny_tokenizer()
    assert len(tokenizer) == p.VOCAB_SIZE
    expected = {
        "<|endoftext|>": p.PAD_ID,
        "<|im_start|>": p.BOS_ID,
        "<|im_end|>": p.EOS_ID,
        "<img>": p.START_IMAGE_ID,
        "</img>": p.END_IMAGE_ID,
        "<IMG_CONTEXT>": p.IMAGE_ID,
    }
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in expected} == expected
    assert (tokenizer.start_image_token, tokenizer.end_image_token, tokenizer.context_image_token) == (
        "<img>",
        "</img>",
        "<IMG_CONTEXT>",
    )
    assert [len(tokenizer(w, add_special_tokens=False)["input_ids"]) for w in ("Red", "Green", "Blue")] == [1, 1, 1]
    config = get_registry().get(FAMILY).tiny_config()
    assert (config.image_token_id, config.text_config.vocab_size, config.text_config.eos_token_id) == (
        p.IMAGE_ID,
        p.VOCAB_SIZE,
        p.EOS_ID,
    )


# --- weights on the wire -----------------------------------------------------------------------------------------


def test_sent_names_are_the_published_layout():
    """OpenGVLab/InternVL3-*-hf and InternVL3_5-*-HF: language_model.model.*, language_model.lm_head.weight,
    vision_tower.* (encoder.layer.{i}, q/k/v_proj, lambda_1/2), multi_modal_projector.{layer_norm,linear_1,linear_2}."""
    model = tiny_model(FAMILY)
    wire = sent_weights(model)
    for name in (
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.1.self_attn.q_proj.weight",
        "language_model.model.layers.1.self_attn.q_proj.bias",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
        "vision_tower.embeddings.cls_token",
        "vision_tower.embeddings.position_embeddings",
        "vision_tower.embeddings.patch_embeddings.projection.weight",
        "vision_tower.encoder.layer.0.attention.q_proj.weight",
        "vision_tower.encoder.layer.1.attention.projection_layer.weight",
        "vision_tower.encoder.layer.0.lambda_1",
        "vision_tower.encoder.layer.0.layernorm_before.weight",
        "vision_tower.encoder.layer.1.mlp.fc2.bias",
        "multi_modal_projector.layer_norm.weight",
        "multi_modal_projector.linear_1.weight",
        "multi_modal_projector.linear_2.bias",
    ):
        assert name in wire, name
    assert not [n for n in wire if n.startswith(("model.", "lm_head"))]
    # Shapes are the in-memory ones (the published layout renames, it does not reshape): e.g. linear_1 takes the
    # pixel-shuffled features, 4 x the vision width (InternVL3-1B-hf: 896 x 4096).
    config = model.config
    assert wire["multi_modal_projector.linear_1.weight"].shape == (
        config.text_config.hidden_size,
        4 * config.vision_config.hidden_size,
    )
    assert wire["vision_tower.embeddings.position_embeddings"].shape == (1, 1 + 4 * 4, config.vision_config.hidden_size)
    assert (
        wire["language_model.lm_head.weight"].data_ptr() != wire["language_model.model.embed_tokens.weight"].data_ptr()
    )


#: InternVL3-1B-hf's shape (Qwen2.5-0.5B decoder with its own lm_head, InternViT-300M on 448 px tiles).
INTERNVL3_1B_SHAPE = {
    "downsample_ratio": 0.5,
    "image_seq_length": 256,
    "image_token_id": 151667,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151674,
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "model_type": "internvl_vision",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "image_size": 448,
        "patch_size": 14,
        "attention_bias": True,
    },
}


def test_names_and_shapes_at_the_published_size():
    """On the meta device at InternVL3-1B-hf's size: the published names carry the published shapes, and the parts
    hold the parameter counts measured from that checkpoint's safetensors header (vision tower 304,012,288,
    projector 4,482,816, embeddings 135,899,904, one decoder layer 14,912,384; 938,193,024 in all)."""

    descriptor = get_registry().get(FAMILY)
    model = build_model(InternVLConfig(**INTERNVL3_1B_SHAPE), descriptor, device="meta")
    wire = {name: tuple(t.shape) for name, t in descriptor.checkpoint_weights(model.named_parameters())}
    assert {
        k: wire[k]
        for k in (
            "language_model.model.embed_tokens.weight",
            "language_model.lm_head.weight",
            "language_model.model.layers.23.self_attn.k_proj.weight",
            "vision_tower.embeddings.cls_token",
            "vision_tower.embeddings.position_embeddings",
            "vision_tower.embeddings.patch_embeddings.projection.weight",
            "vision_tower.encoder.layer.23.attention.q_proj.weight",
            "vision_tower.encoder.layer.0.lambda_1",
            "multi_modal_projector.layer_norm.weight",
            "multi_modal_projector.linear_1.weight",
            "multi_modal_projector.linear_2.weight",
        )
    } == {
        "language_model.model.embed_tokens.weight": (151674, 896),
        "language_model.lm_head.weight": (151674, 896),
        "language_model.model.layers.23.self_attn.k_proj.weight": (128, 896),
        "vision_tower.embeddings.cls_token": (1, 1, 1024),
        "vision_tower.embeddings.position_embeddings": (1, 1025, 1024),
        "vision_tower.embeddings.patch_embeddings.projection.weight": (1024, 3, 14, 14),
        "vision_tower.encoder.layer.23.attention.q_proj.weight": (1024, 1024),
        "vision_tower.encoder.layer.0.lambda_1": (1024,),
        "multi_modal_projector.layer_norm.weight": (4096,),
        "multi_modal_projector.linear_1.weight": (896, 4096),
        "multi_modal_projector.linear_2.weight": (896, 896),
    }

    def count(prefix: str) -> int:
        return sum(math.prod(shape) for name, shape in wire.items() if name.startswith(prefix))

    assert (
        count("vision_tower."),
        count("multi_modal_projector."),
        count("language_model.model.embed_tokens."),
        count("language_model.model.layers.0."),
    ) == (304_012_288, 4_482_816, 135_899_904, 14_912_384)
    assert sum(math.prod(shape) for shape in wire.values()) == 938_193_024


def test_sent_tensors_are_what_save_pretrained_writes(tmp_path: Path):
    """transformers' own writer (5.23) writes exactly the published layout: the same names, values and shapes."""
    model = tiny_model(FAMILY)
    model.save_pretrained(tmp_path)
    saved: dict[str, torch.Tensor] = {}
    for file in tmp_path.glob("*.safetensors"):
        saved.update(load_file(file))
    assert_same_state(sent_weights(model), saved)


def test_sent_tensors_load_back_through_transformers_to_identical_weights(tmp_path: Path):
    model = tiny_model(FAMILY)
    loaded = loaded_back(model, tmp_path)
    assert_same_state(loaded.state_dict(), model.state_dict())


def test_apply_weights_maps_the_published_names_back():
    source, target = vlmreg.resolve(tiny_model(FAMILY, seed=0)), vlmreg.resolve(tiny_model(FAMILY, seed=1))
    assert apply_weights(target, sent_weights(source.model)) == len(list(target.model.parameters()))
    assert_same_state(target.model.state_dict(), source.model.state_dict())


def test_unknown_names_are_refused():
    descriptor = get_registry().get(FAMILY)
    with pytest.raises(ValueError, match="not an InternVL checkpoint name"):
        list(descriptor.memory_weights([("model.language_model.norm.weight", None)]))
    with pytest.raises(ValueError, match="not an InternVL in-memory parameter name"):
        list(descriptor.checkpoint_weights([("vision_tower.embeddings.cls_token", None)]))


def test_lora_on_the_projector_sends_merged_weights_equal_to_peft_s_merge_and_unload():
    resolved = vlmreg.resolve(tiny_model(FAMILY))
    config = peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, **resolved.lora_targets("language+projector").peft_kwargs()
    )
    wrapped = peft.get_peft_model(resolved.model, config)
    plan = WeightPlan.from_resolved(vlmreg.resolve(wrapped), include_frozen_vision=True)
    adapted = {w.name for w in plan.weights if w.adapters}
    assert {"model.multi_modal_projector.linear_1.weight", "model.multi_modal_projector.linear_2.weight"} <= adapted
    merged = copy.deepcopy(wrapped).merge_and_unload()
    expected = {n: p.detach() for n, p in merged.named_parameters()}
    assert_same_state(dict(plan.tensors()), dict(get_registry().get(FAMILY).checkpoint_weights(expected.items())))


# --- processors --------------------------------------------------------------------------------------------------


def _checkpoint_processor_dir(directory: Path) -> Path:
    """The tiny processor saved the way the -hf checkpoints ship theirs: processor_config.json naming
    InternVLProcessor, preprocessor_config.json naming GotOcr2ImageProcessorFast, and a video processor config."""
    get_registry().get(FAMILY).tiny_processor().save_pretrained(directory)
    config = json.loads((directory / "processor_config.json").read_text())
    image = config.pop("image_processor")
    (directory / "processor_config.json").write_text(json.dumps({**config, "processor_class": "InternVLProcessor"}))
    (directory / "preprocessor_config.json").write_text(
        json.dumps(
            {**image, "image_processor_type": "GotOcr2ImageProcessorFast", "processor_class": "InternVLProcessor"}
        )
    )
    (directory / "video_preprocessor_config.json").write_text(
        json.dumps({"video_processor_type": "InternVLVideoProcessor", "processor_class": "InternVLProcessor"})
    )
    return directory


def test_a_checkpoint_s_processor_loads_without_torchvision(tmp_path: Path):
    """AutoProcessor needs torchvision for InternVLVideoProcessor; load_processor gives the image-only processor with
    the directory's tokenizer, template, image settings and tokens per tile."""

    directory = _checkpoint_processor_dir(tmp_path)
    if not is_torchvision_available():
        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(directory)
    processor = get_registry().get(FAMILY).load_processor(directory)
    assert isinstance(processor, InternVLProcessor) and getattr(processor, "video_processor", None) is None
    assert type(processor.image_processor).__name__.startswith("GotOcr2ImageProcessor")
    assert (processor.image_seq_length, processor.image_processor.max_patches) == (4, 4)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the image ?"}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    ids = processor(text=[text], images=[[Image.new("RGB", (64, 64), "red")]], return_tensors="pt")["input_ids"]
    assert int((ids == processor.image_token_id).sum()) == 5 * 4


def test_load_processor_refuses_another_family_s_files(tmp_path: Path):
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    with pytest.raises(ValueError, match="Qwen2VLProcessor"):
        get_registry().get(FAMILY).load_processor(tmp_path)


def test_the_engine_processor_is_the_full_class_or_says_what_it_needs():
    descriptor = get_registry().get(FAMILY)
    tiny = descriptor.tiny_processor()
    if is_torchvision_available():
        full = descriptor.engine_processor(tiny)
        assert type(full) is InternVLProcessor and full.video_processor is not None
    else:
        with pytest.raises(ImportError, match="torchvision"):
            descriptor.engine_processor(tiny)


@pytest.mark.parametrize(
    ("checkpoint", "processor"),
    [
        ("OpenGVLab/InternVL3-1B-hf", "OpenGVLab/InternVL3-1B-hf"),
        ("OpenGVLab/InternVL3-14B-hf", "OpenGVLab/InternVL3-14B-hf"),
        ("/ckpts/InternVL3-78B-hf", "OpenGVLab/InternVL3-78B-hf"),
        ("OpenGVLab/InternVL3_5-8B-HF", "OpenGVLab/InternVL3_5-8B-HF"),
        ("OpenGVLab/InternVL3_5-1B-HF", "OpenGVLab/InternVL3_5-1B-HF"),
        ("runs/my-finetune", "OpenGVLab/InternVL3-1B-hf"),
    ],
)
def test_processor_ids_per_checkpoint(checkpoint: str, processor: str):
    assert get_registry().get(FAMILY).processor_id_for(checkpoint) == processor


def test_no_thinking_modes():
    descriptor = get_registry().get(FAMILY)
    assert descriptor.thinking_modes == () and descriptor.thinking_end is None
