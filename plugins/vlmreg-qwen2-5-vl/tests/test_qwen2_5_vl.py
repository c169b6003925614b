"""The bundled qwen2_5_vl family: conformance, published checkpoint names on the wire, real configs resolving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
from transformers.vision_utils import get_vision_window_index
from vlmreg_qwen_common.processor import TINY_PROCESSOR_DIR

import vlmreg
from vlmreg.broadcast import WeightPlan, apply_weights
from vlmreg.cli import main
from vlmreg.loading.build import build_model, load_config
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import FamilyConformance, tiny_model

FAMILY = "qwen2_5_vl"
CONFIGS = Path(__file__).with_name("configs")


class TestQwen25VlConformance(FamilyConformance):
    family = FAMILY
    distribution = "vlmreg-qwen2-5-vl"


def _sent(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    plan = WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=True)
    return {name: tensor.detach().contiguous().clone() for name, tensor in plan.tensors()}


def test_sent_names_and_values_equal_what_save_pretrained_writes(tmp_path):
    """transformers writes Qwen2.5-VL in the published layout (``visual.*``, ``model.layers.*``), not the in-memory
    one."""
    model = tiny_model(FAMILY)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    sent = _sent(model)
    assert sorted(sent) == sorted(saved)
    assert all(torch.equal(sent[name], saved[name]) for name in saved)
    for name in (
        "visual.blocks.0.attn.qkv.weight",
        "visual.merger.mlp.0.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert name in sent
    assert not [n for n in sent if n.startswith(("model.visual.", "model.language_model."))]


def test_sent_checkpoint_loads_back_through_transformers_to_identical_weights(tmp_path):
    model = tiny_model(FAMILY)
    model.config.save_pretrained(tmp_path)
    save_file(_sent(model), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path)
    expected = model.state_dict()
    assert sorted(loaded.state_dict()) == sorted(expected)
    assert all(torch.equal(t, expected[n]) for n, t in loaded.state_dict().items())


def test_apply_weights_takes_published_names():
    source, target = vlmreg.resolve(tiny_model(FAMILY, seed=0)), vlmreg.resolve(tiny_model(FAMILY, seed=1))
    assert apply_weights(target, _sent(source.model)) == len(list(target.model.parameters()))
    assert all(torch.equal(p, source.model.state_dict()[n]) for n, p in target.model.state_dict().items())


@pytest.mark.parametrize(("size", "layers"), [("3b", 36), ("7b", 28)])
def test_real_config_resolves_with_vlmreg_check(size, layers, capsys):
    directory = CONFIGS / f"qwen2.5-vl-{size}-instruct"
    assert main(["check", str(directory), "--json", "--no-parity"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["family"] == FAMILY
    assert report["num_layers"] == layers and report["num_vision_blocks"] == 32
    assert report["lora_presets"]["language+projector"]["matches"]["merger.mlp.0"] == 1


@pytest.mark.parametrize(("size", "hidden", "kv", "tied"), [("3b", 2048, 256, True), ("7b", 3584, 512, False)])
def test_real_shapes_go_on_the_wire_under_published_names(size, hidden, kv, tied):
    """A meta-device model of the real config: names and shapes as the published safetensors hold them."""

    descriptor = get_registry().get(FAMILY)
    model = build_model(load_config(CONFIGS / f"qwen2.5-vl-{size}-instruct"), descriptor, device="meta")
    shapes = {
        n: tuple(t.shape)
        for n, t in WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=True).shapes()
    }
    assert shapes["visual.patch_embed.proj.weight"] == (1280, 3, 2, 14, 14)
    assert shapes["visual.blocks.31.attn.qkv.weight"] == (3840, 1280)
    assert shapes["visual.blocks.0.mlp.gate_proj.weight"] == (3420, 1280)
    assert shapes["visual.merger.mlp.0.weight"] == (5120, 5120)
    assert shapes["visual.merger.mlp.2.weight"] == (hidden, 5120)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (kv, hidden)
    assert ("lm_head.weight" in shapes) is not tied
    assert not [n for n in shapes if n.startswith(("model.visual.", "model.language_model."))]


def test_tiny_vision_tower_uses_window_attention():
    """The tiny config keeps Qwen2.5-VL's windowed blocks: a 128 x 96 image spans several windows."""
    model = tiny_model(FAMILY)
    visual = model.model.visual
    assert list(model.config.vision_config.fullatt_block_indexes) == [1]
    grid = torch.tensor([[1, 6, 8]])
    if hasattr(visual, "get_window_index"):  # transformers 5.17
        _, cu_window_seqlens = visual.get_window_index(grid)
    else:  # later 5.x: a shared helper
        _, cu_window_seqlens = get_vision_window_index(
            grid,
            spatial_merge_size=visual.spatial_merge_size,
            window_size=visual.window_size,
            patch_size=visual.patch_size,
        )
    assert len(torch.unique_consecutive(torch.as_tensor(cu_window_seqlens))) - 1 > 1


def test_load_processor_reads_a_published_preprocessor_config(tmp_path):
    """A checkpoint directory with Qwen2.5-VL's published image settings (patch 14, CLIP normalisation, pixel bounds)
    loads as the family's processor class, without torchvision; a 448 x 448 image gives 32 x 32 patches, 256 tokens."""

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_PROCESSOR_DIR / name, tmp_path / name)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "min_pixels": 3136,
                "max_pixels": 12845056,
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2_5_VLProcessor",
            }
        )
    )
    processor = get_registry().get(FAMILY).load_processor(tmp_path)
    assert isinstance(processor, Qwen2_5_VLProcessor)
    assert processor.image_processor.patch_size == 14
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=[Image.new("RGB", (448, 448), "red")], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 32, 32]]
    assert int((out["input_ids"] == processor.image_token_id).sum()) == 256
    assert int((out["mm_token_type_ids"] == 1).sum()) == 256


@pytest.mark.parametrize("size", ["3b", "7b"])
def test_benchmark_shapes_match_the_published_configs(size):
    """``shapes`` (random-init configs for GPU benchmarks) have the published text and vision dimensions."""

    shape, real = get_registry().get(FAMILY).config_for_size(size), load_config(CONFIGS / f"qwen2.5-vl-{size}-instruct")
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    ):
        assert getattr(shape.text_config, key) == getattr(real.text_config, key), key
    assert shape.text_config.rope_parameters["mrope_section"] == real.text_config.rope_parameters["mrope_section"]
    for key in (
        "depth",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "patch_size",
        "window_size",
        "fullatt_block_indexes",
        "out_hidden_size",
    ):
        assert getattr(shape.vision_config, key) == getattr(real.vision_config, key), key
    assert shape.tie_word_embeddings == real.tie_word_embeddings
