"""The bundled qwen2_vl family: conformance, published checkpoint names on the wire, a real config resolving."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2VLForConditionalGeneration

import vlmreg
from vlmreg.broadcast import WeightPlan, apply_weights
from vlmreg.cli import main
from vlmreg.loading.build import build_model, load_config
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import FamilyConformance, tiny_model

FAMILY = "qwen2_vl"
CONFIG_7B = Path(__file__).with_name("configs") / "qwen2-vl-7b-instruct"


class TestQwen2VlConformance(FamilyConformance):
    family = FAMILY
    distribution = "vlmreg-qwen2-vl"


def _sent(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    plan = WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=True)
    return {name: tensor.detach().contiguous().clone() for name, tensor in plan.tensors()}


def test_sent_names_and_values_equal_what_save_pretrained_writes(tmp_path):
    """transformers writes Qwen2-VL in the published layout (``visual.*``, ``model.layers.*``), not the in-memory
    one."""
    model = tiny_model(FAMILY)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    sent = _sent(model)
    assert sorted(sent) == sorted(saved)
    assert all(torch.equal(sent[name], saved[name]) for name in saved)
    for name in (
        "visual.blocks.0.attn.qkv.weight",
        "visual.blocks.0.mlp.fc1.weight",
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
    loaded = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path)
    expected = model.state_dict()
    assert sorted(loaded.state_dict()) == sorted(expected)
    assert all(torch.equal(t, expected[n]) for n, t in loaded.state_dict().items())


def test_apply_weights_takes_published_names():
    source, target = vlmreg.resolve(tiny_model(FAMILY, seed=0)), vlmreg.resolve(tiny_model(FAMILY, seed=1))
    assert apply_weights(target, _sent(source.model)) == len(list(target.model.parameters()))
    assert all(torch.equal(p, source.model.state_dict()[n]) for n, p in target.model.state_dict().items())


def test_real_7b_config_resolves_with_vlmreg_check(capsys):
    assert main(["check", str(CONFIG_7B), "--json", "--no-parity"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["family"] == FAMILY
    assert report["num_layers"] == 28 and report["num_vision_blocks"] == 32
    assert report["lora_presets"]["language+projector"]["matches"]["merger.mlp.2"] == 1


def test_real_7b_shapes_go_on_the_wire_under_published_names():
    """A meta-device model of the real config: names and shapes as the published safetensors hold them."""

    model = build_model(load_config(CONFIG_7B), get_registry().get(FAMILY), device="meta")
    shapes = {
        n: tuple(t.shape)
        for n, t in WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=True).shapes()
    }
    assert shapes["visual.patch_embed.proj.weight"] == (1280, 3, 2, 14, 14)
    assert shapes["visual.blocks.31.attn.qkv.weight"] == (3840, 1280)
    assert shapes["visual.blocks.0.mlp.fc1.weight"] == (5120, 1280)
    assert shapes["visual.merger.mlp.0.weight"] == (5120, 5120)
    assert shapes["visual.merger.mlp.2.weight"] == (3584, 5120)
    assert shapes["model.layers.27.self_attn.k_proj.weight"] == (512, 3584)
    assert shapes["lm_head.weight"] == (152064, 3584)
    assert not [n for n in shapes if n.startswith(("model.visual.", "model.language_model."))]
