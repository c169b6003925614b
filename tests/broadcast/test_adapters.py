"""Adapter syncs at the plan level: what travels as adapters and what merged, checked against peft's own merge."""

from __future__ import annotations

import copy
import re

import peft
import pytest
import torch
from peft.tuners.lora import LoraLayer

import vlmreg
from vlmreg.broadcast import BroadcastError, LayoutMismatchError, WeightPlan, apply_weights
from vlmreg.broadcast.adapters import split_modules
from vlmreg.broadcast.plan import lora_modules, served_lora
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import tiny_model

from .helpers import assert_state_equal


def _lora(family: str, preset: str, seed: int):
    """A tiny model of ``family`` (base weights from ``seed``) with random adapters (peft's
    ``init_lora_weights=False``)."""
    resolved = vlmreg.resolve(tiny_model(family, seed=seed))
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **resolved.lora_targets(preset).peft_kwargs())
    return peft.get_peft_model(resolved.model, config)


def _merged(model) -> dict[str, torch.Tensor]:
    """peft's own ``merge_and_unload`` of a copy: the weights the model computes with."""
    return {n: p.detach() for n, p in copy.deepcopy(model).merge_and_unload().named_parameters()}


@pytest.mark.parametrize(("family", "preset"), [("qwen3_vl", "all-linear"), ("qwen3_5_moe", "language+experts")])
def test_adapter_syncs_leave_a_receiver_with_the_same_lora_computing_with_the_sender_s_weights(family, preset):
    """Sender and receiver differ in base weights and adapters. After the full sync, and after a step sync of changed
    adapters, peft's merge of the receiver equals peft's merge of the sender; fused-expert LoRA (``target_parameters``)
    travels merged and zeroes the receiver's own."""
    sender, receiver = _lora(family, preset, seed=0), _lora(family, preset, seed=1)
    resolved = vlmreg.resolve(sender)
    adapted, keepable = lora_modules(resolved)
    split = split_modules(adapted, keepable, list(keepable))
    assert split.adapters == frozenset(keepable)
    fused = set(adapted) - set(keepable)
    assert bool(fused) == (family == "qwen3_5_moe") and all(
        reason.startswith("fused-parameter") for reason in split.merged.values()
    )
    plans = {
        kind: WeightPlan.from_resolved(resolved, include_frozen_vision=kind == "full", lora_modules=split.adapters)
        for kind in ("full", "step")
    }
    apply_weights(vlmreg.resolve(receiver), dict(plans["full"].tensors()))
    assert_state_equal(_merged(receiver), _merged(sender))
    with torch.no_grad():
        for name, parameter in sender.named_parameters():
            if "lora_" in name:
                parameter.mul_(1.5)
    step = dict(plans["step"].tensors())
    adapter_bytes = sum(
        p.numel() * p.element_size()
        for n, p in sender.named_parameters()
        if "lora_" in n and not any(f in n for f in fused)
    )
    factors = {n: t for n, t in step.items() if ".lora_" in n}
    assert sum(t.numel() * t.element_size() for t in factors.values()) == adapter_bytes
    weights = [n for n in step if n not in factors]
    assert bool(weights) == bool(fused)  # only merged experts travel as weights in a step sync
    apply_weights(vlmreg.resolve(receiver), step)
    assert_state_equal(_merged(receiver), _merged(sender))


def test_a_server_serving_another_rank_or_scaling_is_refused_naming_the_module():
    resolved = vlmreg.resolve(_lora("qwen3_vl", "language", seed=0))
    adapted, keepable = lora_modules(resolved)
    module = sorted(keepable)[0]
    with pytest.raises(
        BroadcastError,
        match=rf"{module}: the server serves LoRA of rank 8 scaling 2.0, the trainer's is rank 4 scaling 2.0",
    ):
        split_modules(adapted, keepable, {module: {"r": 8, "scaling": 2.0}})
    assert split_modules(adapted, keepable, {}).adapters == frozenset()  # a server with no LoRA: everything merged


def test_a_receiver_refuses_adapters_for_a_module_it_has_no_lora_on():
    sender = _lora("qwen3_vl", "language", seed=0)
    resolved = vlmreg.resolve(sender)
    _, keepable = lora_modules(resolved)
    plan = WeightPlan.from_resolved(resolved, include_frozen_vision=False, lora_modules=frozenset(keepable))
    plain = vlmreg.resolve(tiny_model("qwen3_vl", seed=1))
    with pytest.raises(
        LayoutMismatchError,
        match=r"received adapter 'base_model\.model\..*\.lora_A\.weight', but this qwen3_vl model has no LoRA on",
    ):
        apply_weights(plain, dict(plan.tensors()))


def test_factors_travel_in_the_dtype_asked_for():
    """vLLM computes LoRA in the model's dtype: the factors go in it (half of peft's fp32 for a bf16 model)."""
    resolved = vlmreg.resolve(_lora("qwen3_vl", "language", seed=0))
    _, keepable = lora_modules(resolved)
    own = WeightPlan.from_resolved(resolved, include_frozen_vision=False, lora_modules=frozenset(keepable))
    half = WeightPlan.from_resolved(
        resolved, include_frozen_vision=False, lora_modules=frozenset(keepable), lora_dtype=torch.bfloat16
    )
    sent, shapes = dict(half.tensors()), dict(half.shapes())
    assert sent.keys() == dict(own.tensors()).keys() == shapes.keys()
    for name, tensor in own.tensors():
        assert tensor.dtype == torch.float32 and sent[name].dtype == shapes[name].dtype == torch.bfloat16
        assert torch.equal(sent[name], tensor.to(torch.bfloat16))


def test_factors_cast_for_another_dtype_are_the_same_memory_every_sync():
    """A sync in another dtype casts into one buffer kept from sync to sync, so the tensors sent are where they were
    (a CUDA IPC receiver then reuses its mapping), holding each sync's values (torch's own cast of the factors)."""
    resolved = vlmreg.resolve(_lora("qwen3_vl", "language", seed=0))
    _, keepable = lora_modules(resolved)
    plan = WeightPlan.from_resolved(
        resolved, include_frozen_vision=False, lora_modules=frozenset(keepable), lora_dtype=torch.bfloat16
    )
    first = [(name, tensor.data_ptr()) for name, tensor in plan.tensors()]
    with torch.no_grad():
        for module in keepable.values():
            for _, factor in module.factors:
                factor.add_(1.0)
    second = list(plan.tensors())
    assert [(name, tensor.data_ptr()) for name, tensor in second] == first
    assert len({ptr for _, ptr in first}) == len(first)  # one place per factor
    factors = dict(factor for module in keepable.values() for factor in module.factors)
    for name, tensor in second:
        assert torch.equal(tensor, factors[name].detach().to(torch.bfloat16)), name


def _lora_layer_names(model) -> list[str]:
    """peft's own LoRA layers, by module name (the reference for what vlmreg calls adapted modules)."""
    return [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def test_served_lora_is_each_lora_layer_s_rank_and_scaling():
    """r = 4, lora_alpha = 8: peft's scaling alpha / r = 2.0, for each of peft's LoRA layers."""
    model = _lora("qwen3_vl", "language", seed=0)
    served = served_lora(vlmreg.resolve(model))
    assert sorted(served) == sorted(n.removeprefix("base_model.model.") for n in _lora_layer_names(model))
    assert all(entry == {"r": 4, "scaling": 2.0} for entry in served.values())


def test_an_adapter_plan_counts_its_weights_and_both_factors_of_each_module():
    model = _lora("qwen3_vl", "language", seed=0)
    resolved = vlmreg.resolve(model)
    _, keepable = lora_modules(resolved)
    plan = WeightPlan.from_resolved(resolved, include_frozen_vision=True, lora_modules=frozenset(keepable))
    sent = dict(plan.tensors())
    factors = [n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]  # peft's own
    assert len(plan) == len(sent) and sum(".lora_" in n for n in sent) == len(factors) == 2 * len(keepable)


def test_without_lora_base_the_adapted_modules_base_weights_are_not_sent():
    """``lora_base=False`` (vLLM): the base weights of the modules that travel as adapters stay out, every other
    weight goes as in the full sync."""
    model = _lora("qwen3_vl", "language", seed=0)
    resolved = vlmreg.resolve(model)
    _, keepable = lora_modules(resolved)
    full = WeightPlan.from_resolved(resolved, include_frozen_vision=True, lora_modules=frozenset(keepable))
    lean = WeightPlan.from_resolved(
        resolved, include_frozen_vision=True, lora_modules=frozenset(keepable), lora_base=False
    )
    bases = {n.removeprefix("base_model.model.") + ".weight" for n in _lora_layer_names(model)}
    assert bases <= {w.name for w in full.weights}
    assert [w.name for w in lean.weights] == [w.name for w in full.weights if w.name not in bases]
    assert [n for n, _ in lean.adapter_tensors()] == [n for n, _ in full.adapter_tensors()]


def test_modules_that_are_not_plain_lora_cannot_travel_as_adapters_naming_the_first():
    resolved = vlmreg.resolve(_lora("qwen3_vl", "language", seed=0))
    with pytest.raises(
        BroadcastError, match=r"^nope\.a: not a plain LoRA module of this model, so it cannot travel as an adapter$"
    ):
        WeightPlan.from_resolved(resolved, include_frozen_vision=True, lora_modules=frozenset({"nope.b", "nope.a"}))


def test_a_merged_sync_into_a_receiver_with_lora_silences_its_adapters():
    """Everything merged by the sender (a server whose LoRA the trainer does not match): the receiver's adapters must
    add nothing, so peft's merge of the receiver is the sender's merge."""
    sender, receiver = _lora("qwen3_vl", "language", seed=0), _lora("qwen3_vl", "language", seed=1)
    merged = WeightPlan.from_resolved(vlmreg.resolve(sender), include_frozen_vision=True)
    apply_weights(vlmreg.resolve(receiver), dict(merged.tensors()))
    assert_state_equal(_merged(receiver), _merged(sender))


@pytest.mark.parametrize("factor", ["A", "B"])
def test_a_base_weight_with_one_factor_of_its_module_keeps_that_adapter(factor):
    """A module's adapter is silenced only when neither factor of it came with its base weight."""
    sender, receiver = _lora("qwen3_vl", "language", seed=0), _lora("qwen3_vl", "language", seed=1)
    resolved = vlmreg.resolve(sender)
    _, keepable = lora_modules(resolved)
    module = sorted(keepable)[0]
    plan = WeightPlan.from_resolved(resolved, include_frozen_vision=True, lora_modules=frozenset(keepable))
    sent = dict(plan.tensors())
    received = {module + ".weight": sent[module + ".weight"]}
    received.update({n: t for n, t in sent.items() if n.startswith(f"base_model.model.{module}.lora_{factor}.")})
    assert len(received) == 2
    target = dict(receiver.named_parameters())
    kept_b = target[f"base_model.model.{module}.lora_B.default.weight"].detach().clone()
    apply_weights(vlmreg.resolve(receiver), received)
    b = target[f"base_model.model.{module}.lora_B.default.weight"]
    expected = sent[f"base_model.model.{module}.lora_B.weight"] if factor == "B" else kept_b
    assert torch.equal(b, expected) and b.abs().sum() > 0


def test_an_adapter_factor_of_another_shape_is_refused_naming_it():
    sender = _lora("qwen3_vl", "language", seed=0)
    resolved = vlmreg.resolve(sender)
    _, keepable = lora_modules(resolved)
    plan = WeightPlan.from_resolved(resolved, include_frozen_vision=True, lora_modules=frozenset(keepable))
    sent = dict(plan.tensors())
    name = next(n for n in sent if ".lora_A." in n)
    rows, columns = sent[name].shape
    sent[name] = torch.zeros(rows + 1, columns)
    with pytest.raises(
        LayoutMismatchError,
        match=rf"^{re.escape(name)}: received \({rows + 1}, {columns}\) float32, the model has \({rows}, {columns}\) "
        "float32$",
    ):
        apply_weights(vlmreg.resolve(_lora("qwen3_vl", "language", seed=1)), sent)


def test_factors_already_in_the_asked_dtype_are_sent_as_they_are():
    resolved = vlmreg.resolve(_lora("qwen3_vl", "language", seed=0))
    _, keepable = lora_modules(resolved)
    plan = WeightPlan.from_resolved(
        resolved, include_frozen_vision=False, lora_modules=frozenset(keepable), lora_dtype=torch.float32
    )
    factors = dict(factor for module in keepable.values() for factor in module.factors)
    sent = [(n, t) for n, t in plan.tensors() if n in factors]
    assert len(sent) == len(factors) and all(t is factors[n] for n, t in sent)
    assert all(t.device.type == "meta" for n, t in plan.shapes() if n in factors)


def test_fsdp_sharded_factors_are_refused_naming_the_factor_and_the_setting():
    class Shard:
        dtype = torch.float32

        def full_tensor(self):
            return torch.zeros(2)

    class Module:
        factors = (("base_model.model.x.lora_A.weight", Shard()),)

    plan = WeightPlan(get_registry().get("qwen3_vl"), (), False, (Module(),))
    message = (
        "base_model.model.x.lora_A.weight: adapter syncs from FSDP-sharded LoRA are not supported; set "
        'broadcast.lora_sync = "merged"'
    )
    with pytest.raises(BroadcastError, match=f"^{re.escape(message)}$"):
        list(plan.tensors())
