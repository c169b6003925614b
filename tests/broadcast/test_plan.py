"""What a sync sends: checkpoint names and values equal to save_pretrained's files; frozen vision once; LoRA merged."""

from __future__ import annotations

import copy
from pathlib import Path

import attrs
import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

import vlmreg
from vlmreg.broadcast import (
    BroadcastError,
    LayoutMismatchError,
    WeightPlan,
    apply_weights,
)
from vlmreg.broadcast.filesystem import FilesystemReader, FilesystemSender
from vlmreg.broadcast.plan import PlannedWeight, _named_weights
from vlmreg.loading.build import build_model, model_class_for
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import tiny_model

from .helpers import assert_state_equal, bundled_families, frozen_vision

FAMILIES = bundled_families()


def saved_tensors(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(directory)
    tensors: dict[str, torch.Tensor] = {}
    for file in directory.glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


def test_every_bundled_family_is_covered():
    assert {"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"} <= set(FAMILIES)


# transformers' save_pretrained writes qwen3_vl_moe's fused experts in the in-memory layout (its reverse of the
# load-time transpose does nothing), so for it the reference is the loader round trip below, not save_pretrained.
# gemma3, llava_onevision and paligemma checkpoints name the vision tower vision_tower.vision_model.*, while
# save_pretrained drops the vision_model segment (transformers loads both); the plugin's own tests compare with the
# published layout.
SAVED_AS_PUBLISHED = [f for f in FAMILIES if f not in ("qwen3_vl_moe", "gemma3", "llava_onevision", "paligemma")]


@pytest.mark.parametrize("family", SAVED_AS_PUBLISHED)
def test_plan_equals_what_save_pretrained_writes(family, tmp_path):
    model = tiny_model(family)
    resolved = frozen_vision(vlmreg.resolve(model))
    saved = saved_tensors(model, tmp_path)
    full = dict(WeightPlan.from_resolved(resolved, include_frozen_vision=True).tensors())
    assert_state_equal(full, saved)
    step = dict(WeightPlan.from_resolved(resolved, include_frozen_vision=False).tensors())
    assert_state_equal(step, {name: saved[name] for name in step})


@pytest.mark.parametrize("family", FAMILIES)
def test_what_is_sent_loads_back_through_transformers_to_identical_weights(family, tmp_path):
    """The sent tensors, written as a checkpoint beside the config, go through transformers' own loader (its
    checkpoint conversions included) and give back exactly the trainer's weights."""

    model = tiny_model(family)
    resolved = vlmreg.resolve(model)
    sent = {
        n: t.contiguous().clone() for n, t in WeightPlan.from_resolved(resolved, include_frozen_vision=True).tensors()
    }
    model.config.save_pretrained(tmp_path)
    save_file(sent, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = model_class_for(resolved.descriptor).from_pretrained(tmp_path)
    assert_state_equal(loaded.state_dict(), model.state_dict())


def test_qwen3_vl_moe_experts_are_sent_in_the_published_layout():
    """Published Qwen3-VL-MoE checkpoints store gate_up_proj as (E, H, 2I) and down_proj as (E, I, H); vLLM's
    loader expects that. In memory transformers holds them transposed."""
    model = tiny_model("qwen3_vl_moe")
    text = model.config.text_config
    experts, hidden, inner = text.num_experts, text.hidden_size, text.moe_intermediate_size
    assert 2 * inner != hidden  # a square shape would hide the layout
    sent = dict(WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=True).tensors())
    prefix = "model.language_model.layers.0.mlp.experts."
    assert tuple(sent[prefix + "gate_up_proj"].shape) == (experts, hidden, 2 * inner)
    assert tuple(sent[prefix + "down_proj"].shape) == (experts, inner, hidden)
    in_memory = dict(model.named_parameters())[prefix + "gate_up_proj"]
    assert torch.equal(sent[prefix + "gate_up_proj"], in_memory.transpose(1, 2))


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_weights_maps_checkpoint_names_back_in_place(family):
    source, target = vlmreg.resolve(tiny_model(family, seed=0)), vlmreg.resolve(tiny_model(family, seed=1))
    before = {n: p for n, p in target.model.named_parameters()}
    written = apply_weights(target, dict(WeightPlan.from_resolved(source, include_frozen_vision=True).tensors()))
    assert written == len(before)
    assert all(p is before[n] for n, p in target.model.named_parameters())  # copied into, not replaced
    assert_state_equal(target.model.state_dict(), source.model.state_dict())


def test_fused_experts_go_on_the_wire_unfused():
    resolved = vlmreg.resolve(tiny_model("qwen3_5_moe"))
    names = [name for name, _ in WeightPlan.from_resolved(resolved, include_frozen_vision=False).tensors()]
    assert "model.language_model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert not any(name.endswith("experts.gate_up_proj") for name in names)


def test_frozen_vision_is_sent_only_in_the_full_plan():
    resolved = frozen_vision(vlmreg.resolve(tiny_model("qwen3_vl")))
    step = [name for name, _ in WeightPlan.from_resolved(resolved, include_frozen_vision=False).tensors()]
    full = [name for name, _ in WeightPlan.from_resolved(resolved, include_frozen_vision=True).tensors()]
    assert not any(n.startswith(("model.visual.blocks.", "model.visual.patch_embed.")) for n in step)
    assert any(n.startswith("model.visual.merger.") for n in step)  # trainable connector: every step
    assert any(n.startswith("model.visual.blocks.") for n in full)
    assert [n for n in full if n.startswith(("model.language_model.", "lm_head."))] == [
        n for n in step if not n.startswith("model.visual.")
    ]


def test_tied_lm_head_is_not_sent(tmp_path):
    descriptor = get_registry().get("qwen3_vl")
    config = descriptor.tiny_config()
    config.tie_word_embeddings = True
    model = build_model(config, descriptor)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    sent = dict(WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=True).tensors())
    assert "lm_head.weight" not in sent and "model.language_model.embed_tokens.weight" in sent
    assert_state_equal(sent, saved_tensors(model, tmp_path))


def _lora(family: str, preset: str, **extra):
    resolved = vlmreg.resolve(tiny_model(family))
    targets = resolved.lora_targets(preset)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **targets.peft_kwargs(), **extra)
    return peft.get_peft_model(resolved.model, config)


@pytest.mark.parametrize(("family", "preset"), [("qwen3_vl", "all-linear"), ("qwen3_5_moe", "language+experts")])
def test_lora_sends_merged_weights_equal_to_merge_and_unload(family, preset):
    wrapped = _lora(family, preset)
    resolved = vlmreg.resolve(wrapped)
    base = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
    plan = WeightPlan.from_resolved(resolved, include_frozen_vision=True)
    sent = dict(plan.memory_tensors())
    merged = copy.deepcopy(wrapped).merge_and_unload()
    assert_state_equal(sent, {n: p.detach() for n, p in merged.named_parameters()})
    assert_state_equal({n: p.detach() for n, p in wrapped.named_parameters()}, base)  # nothing merged in place
    assert any(w.adapters for w in plan.weights)
    assert (
        dict(plan.tensors()).keys()
        == dict(WeightPlan.from_resolved(vlmreg.resolve(merged), include_frozen_vision=True).tensors()).keys()
    )


def test_lora_variants_are_refused_with_the_module_name():
    resolved = vlmreg.resolve(_lora("qwen3_vl", "language", use_dora=True))
    with pytest.raises(
        BroadcastError,
        match=r"q_proj: adapter 'default' is a LoRA variant \(\w+\); the broadcaster merges plain LoRA only \(W \+ "
        r"scaling \* B @ A\)",
    ):
        WeightPlan.from_resolved(resolved, include_frozen_vision=False)


def test_apply_weights_checks_everything_before_copying():
    target = vlmreg.resolve(tiny_model("qwen3_vl", seed=1))
    before = copy.deepcopy(target.model.state_dict())
    sent = dict(WeightPlan.from_resolved(vlmreg.resolve(tiny_model("qwen3_vl")), include_frozen_vision=True).tensors())
    sent["model.language_model.norm.weight"] = torch.zeros(3)
    with pytest.raises(
        LayoutMismatchError,
        match=r"model.language_model.norm.weight: received \(3,\) float32, the model has \(64,\) float32",
    ):
        apply_weights(target, sent)
    assert_state_equal(target.model.state_dict(), before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_apply_weights_refuses_a_weight_of_the_wrong_dtype_and_copies_nothing(dtype):
    """Same name, same shape, another dtype: refused, not converted on copy (the engine would run other numbers)."""
    target = vlmreg.resolve(tiny_model("qwen3_vl", seed=1))
    before = copy.deepcopy(target.model.state_dict())
    sent = dict(WeightPlan.from_resolved(vlmreg.resolve(tiny_model("qwen3_vl")), include_frozen_vision=True).tensors())
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    sent[name] = sent[name].to(dtype)
    shape = tuple(sent[name].shape)
    with pytest.raises(
        LayoutMismatchError,
        match=rf"{name}: received \({shape[0]}, {shape[1]}\) {str(dtype)[6:]}, the model has \({shape[0]}, "
        rf"{shape[1]}\) float32",
    ):
        apply_weights(target, sent)
    assert_state_equal(target.model.state_dict(), before)


def test_every_sync_leaves_the_engine_with_the_merged_weights_lora_adapted_frozen_vision_included(tmp_path):
    """Three syncs through the filesystem transport (a full one, then two step syncs) with LoRA adapters on the frozen
    vision blocks as well as the language model, the adapters changed between syncs as training does. After each sync
    the receiving plain model holds exactly peft's own ``merge_and_unload`` of the trainer's model at that moment:
    every sync's tensors are checked, not only the first's."""

    wrapped = _lora("qwen3_vl", "all-linear")
    resolved = vlmreg.resolve(wrapped)
    vision = resolved.descriptor.vision_encoder_attr
    full = WeightPlan.from_resolved(resolved, include_frozen_vision=True)
    # the case under test: adapters on vision weights whose base is frozen
    assert any(w.adapters and w.name.startswith(vision + ".blocks.") for w in full.weights)
    writers = {
        full: FilesystemSender(tmp_path / "weights", resolved, include_frozen_vision=full, keep=0)
        for full in (True, False)
    }
    reader = FilesystemReader(tmp_path / "weights")
    engine = vlmreg.resolve(tiny_model("qwen3_vl", seed=3))
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        if step:
            with torch.no_grad():  # an optimizer step's worth of change to every adapter
                for name, p in wrapped.named_parameters():
                    if "lora_" in name:
                        p.add_(torch.randn(p.shape, generator=generator) * 0.1)
        _, received = reader.load(writers[step == 0].write(step + 1))
        apply_weights(engine, received)
        merged = copy.deepcopy(wrapped).merge_and_unload()
        assert_state_equal(engine.model.state_dict(), merged.state_dict())


def test_a_head_registered_before_its_tied_embedding_is_sent_under_the_embeddings_name():
    """``save_pretrained`` drops a tied lm_head whatever order the modules were registered in; so does the plan."""

    class HeadFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(4, 6, bias=False)
            self.embed = torch.nn.Embedding(6, 4)
            self.embed.weight = self.lm_head.weight

    weights = _named_weights(HeadFirst(), "lm_head")
    assert [w.name for w in weights] == ["embed.weight"]


def test_an_fsdp_shard_is_gathered_and_refuses_merging_adapters():
    """A sharded parameter (anything with ``full_tensor``, as a DTensor) is sent gathered, never as the local shard."""

    class Shard:
        def full_tensor(self):
            return torch.arange(4.0)

    assert torch.equal(PlannedWeight("w", Shard()).value(), torch.arange(4.0))
    with pytest.raises(BroadcastError, match="w: merging LoRA adapters into FSDP-sharded weights is not supported"):
        PlannedWeight("w", Shard(), ((object(), "default"),)).value()


def test_the_planned_shapes_are_save_pretrained_s_without_touching_a_weight(tmp_path):
    """`WeightPlan.shapes` (names, shapes and dtypes on the wire, as meta tensors) against the checkpoint files."""
    model = tiny_model("qwen3_5_moe")  # fused experts: the wire shapes differ from the in-memory ones
    saved = saved_tensors(model, tmp_path)
    shapes = dict(WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=True).shapes())
    assert sorted(shapes) == sorted(saved)
    assert all(t.device.type == "meta" for t in shapes.values())
    assert {n: (tuple(t.shape), t.dtype) for n, t in shapes.items()} == {
        n: (tuple(t.shape), t.dtype) for n, t in saved.items()
    }


def test_an_adapter_with_a_lora_bias_is_refused_naming_the_module():
    resolved = vlmreg.resolve(_lora("qwen3_vl", "language", lora_bias=True))
    with pytest.raises(
        BroadcastError,
        match=r"^model\.language_model\.layers\.0\.self_attn\.q_proj: adapter 'default' has lora_bias=True, which the "
        r"broadcaster does not merge$",
    ):
        WeightPlan.from_resolved(resolved, include_frozen_vision=False)


def test_a_lora_variant_is_named_by_peft_s_class():
    wrapped = _lora("qwen3_vl", "language", use_dora=True)
    layer = wrapped.get_submodule("base_model.model.model.language_model.layers.0.self_attn.q_proj")
    variant = type(layer.lora_variant["default"]).__name__  # peft's own
    with pytest.raises(BroadcastError, match=rf"is a LoRA variant \({variant}\)"):
        WeightPlan.from_resolved(vlmreg.resolve(wrapped), include_frozen_vision=False)


def test_other_peft_wrappers_are_refused_naming_the_module_and_the_wrapper():
    wrapped = _lora("qwen3_vl", "language", modules_to_save=["lm_head"])
    wrapper = type(wrapped.get_submodule("base_model.model.lm_head")).__name__  # peft's own
    with pytest.raises(
        BroadcastError,
        match=rf"^lm_head: peft {wrapper} is not supported by the broadcaster \(plain LoRA layers "
        r"only\)$",
    ):
        WeightPlan.from_resolved(vlmreg.resolve(wrapped), include_frozen_vision=False)


def test_adapters_already_merged_into_the_base_are_not_merged_again():
    """peft's ``merge_adapter`` writes the delta into the base weights: a plan then sends them as they are."""
    wrapped = _lora("qwen3_vl", "language")
    reference = {n: p.detach() for n, p in copy.deepcopy(wrapped).merge_and_unload().named_parameters()}
    wrapped.merge_adapter()
    sent = dict(WeightPlan.from_resolved(vlmreg.resolve(wrapped), include_frozen_vision=True).memory_tensors())
    assert sent.keys() == reference.keys()
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


def test_received_tensors_that_map_to_no_parameter_are_refused_naming_them():
    target = vlmreg.resolve(tiny_model("qwen3_vl", seed=1))
    sent = dict(WeightPlan.from_resolved(vlmreg.resolve(tiny_model("qwen3_vl")), include_frozen_vision=True).tensors())
    sent["model.language_model.extra.weight"] = torch.zeros(2)
    with pytest.raises(
        LayoutMismatchError,
        match=r"^received 'model\.language_model\.extra\.weight', but this qwen3_vl model has no such parameter$",
    ):
        apply_weights(target, sent)
    moe = vlmreg.resolve(tiny_model("qwen3_5_moe", seed=1))
    sent = dict(
        WeightPlan.from_resolved(vlmreg.resolve(tiny_model("qwen3_5_moe")), include_frozen_vision=True).tensors()
    )
    del sent["model.language_model.layers.0.mlp.experts.3.gate_proj.weight"]  # the family cannot fuse the layer back
    with pytest.raises(LayoutMismatchError, match=r"^received weights do not map to qwen3_5_moe parameters: \S"):
        apply_weights(moe, sent)


def test_a_parameter_under_two_names_is_sent_under_its_first_as_torch_lists_it():
    """Shared outside the lm_head, a parameter keeps the name torch's own ``named_parameters`` gives it (the first);
    a module that is itself called ``base_layer``, without peft, keeps its name."""

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(4, 4, bias=False)
            self.base_layer = torch.nn.Linear(4, 4, bias=False)
            self.second = torch.nn.Linear(4, 4, bias=False)
            self.second.weight = self.first.weight

    model = Shared()
    assert [w.name for w in _named_weights(model, "lm_head")] == [n for n, _ in model.named_parameters()]


def test_the_planned_shapes_of_a_bf16_model_are_save_pretrained_s(tmp_path):
    model = tiny_model("qwen3_vl").to(torch.bfloat16)
    saved = saved_tensors(model, tmp_path)
    shapes = dict(WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=True).shapes())
    assert {n: (tuple(t.shape), t.dtype) for n, t in shapes.items()} == {
        n: (tuple(t.shape), t.dtype) for n, t in saved.items()
    }


def test_a_vision_tower_under_the_language_model_s_root_is_sent_once():
    """A family whose language model root holds the vision tower too (older LLaVA layouts: ``model.vision_tower``
    beside ``model.layers``): every parameter once, as torch lists them."""
    model = tiny_model("qwen3_vl")
    resolved = vlmreg.resolve(model)
    nested = attrs.evolve(resolved, descriptor=attrs.evolve(resolved.descriptor, language_model_attr="model"))
    names = [w.name for w in WeightPlan.from_resolved(nested, include_frozen_vision=True).weights]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
