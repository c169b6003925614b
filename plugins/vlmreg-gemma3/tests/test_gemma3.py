"""The bundled gemma3 family: the conformance suite, the published checkpoint layout on the wire, processors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoProcessor

import vlmreg
from vlmreg.broadcast import WeightPlan, apply_weights
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import FamilyConformance, tiny_model
from vlmreg.testing.weights import assert_same_state, loaded_back, sent_weights

FAMILY = "gemma3"


class TestGemma3Conformance(FamilyConformance):
    family = FAMILY
    distribution = "vlmreg-gemma3"


def test_sent_names_are_the_published_layout():
    """google/gemma-3-*-it checkpoints: language_model.model.*, vision_tower.vision_model.*, multi_modal_projector.*;
    the lm_head is tied to the embeddings and absent."""
    names = set(sent_weights(tiny_model(FAMILY)))
    assert "language_model.model.embed_tokens.weight" in names
    assert "language_model.model.layers.1.self_attn.q_proj.weight" in names
    assert "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight" in names
    assert "vision_tower.vision_model.post_layernorm.weight" in names
    assert {
        "multi_modal_projector.mm_input_projection_weight",
        "multi_modal_projector.mm_soft_emb_norm.weight",
    } <= names
    assert not [n for n in names if n.startswith(("model.", "lm_head", "language_model.lm_head"))]


def test_sent_tensors_are_save_pretrained_s_but_for_the_vision_wrapper(tmp_path: Path):
    """Against transformers' own writer: the same tensors, values and shapes; the names differ only where
    save_pretrained drops the SigLIP ``vision_model.`` segment that the published checkpoints keep."""
    model = tiny_model(FAMILY)
    model.save_pretrained(tmp_path)
    saved: dict[str, torch.Tensor] = {}
    for file in tmp_path.glob("*.safetensors"):
        saved.update(load_file(file))
    wire = {
        name.replace("vision_tower.vision_model.", "vision_tower.", 1): t for name, t in sent_weights(model).items()
    }
    assert_same_state(wire, saved)


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
    with pytest.raises(ValueError, match="not a Gemma 3 checkpoint name"):
        list(descriptor.memory_weights([("model.language_model.norm.weight", None)]))


def test_the_projector_matrix_is_initialised_so_pixels_reach_the_logits():
    projector = tiny_model(FAMILY).get_submodule("model.multi_modal_projector")
    assert torch.count_nonzero(projector.mm_input_projection_weight) == projector.mm_input_projection_weight.numel()


def test_a_checkpoint_s_processor_files_load_without_torchvision(tmp_path: Path):
    """A real checkpoint ships preprocessor_config.json naming Gemma3ImageProcessor: AutoProcessor gives the whole
    Gemma3Processor here (PIL image processor), so the family needs no load_processor."""

    get_registry().get(FAMILY).tiny_processor().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "processor_config.json").read_text())
    image = config.pop("image_processor")
    (tmp_path / "processor_config.json").write_text(json.dumps(config))
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**image, "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor"})
    )
    loaded = AutoProcessor.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "Gemma3Processor" and loaded.image_processor is not None


@pytest.mark.parametrize(
    ("checkpoint", "processor"),
    [
        ("google/gemma-3-4b-it", "google/gemma-3-4b-it"),
        ("google/gemma-3-27b-it", "google/gemma-3-27b-it"),
        ("/ckpts/gemma-3-12b-pt", "google/gemma-3-12b-pt"),
        ("google/medgemma-4b-it", "google/medgemma-4b-it"),
        ("runs/my-finetune", "google/gemma-3-4b-it"),
    ],
)
def test_processor_ids_per_checkpoint(checkpoint: str, processor: str):
    assert get_registry().get(FAMILY).processor_id_for(checkpoint) == processor


def test_no_thinking_modes():
    descriptor = get_registry().get(FAMILY)
    assert descriptor.thinking_modes == () and descriptor.thinking_end is None


@pytest.mark.parametrize("preset", ["language+projector", "all-linear"])
def test_lora_sends_merged_weights_equal_to_peft_s_merge_and_unload(preset: str):
    """The projector matrix is adapted as a peft target parameter; what is sent is peft's own merge, published names."""

    resolved = vlmreg.resolve(tiny_model(FAMILY))
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **resolved.lora_targets(preset).peft_kwargs())
    wrapped = peft.get_peft_model(resolved.model, config)
    plan = WeightPlan.from_resolved(vlmreg.resolve(wrapped), include_frozen_vision=True)
    assert "model.multi_modal_projector.mm_input_projection_weight" in {w.name for w in plan.weights if w.adapters}
    merged = copy.deepcopy(wrapped).merge_and_unload()
    # the tied lm_head is listed once, as the embeddings
    expected = {n: p.detach() for n, p in merged.named_parameters()}
    assert_same_state(dict(plan.tensors()), dict(get_registry().get(FAMILY).checkpoint_weights(expected.items())))
