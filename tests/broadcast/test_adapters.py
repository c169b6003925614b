"""Adapter syncs at the plan level: what travels as adapters and what merged, checked against peft's own merge."""

from __future__ import annotations

import copy

import peft
import pytest
import torch

import vlmreg
from vlmreg.broadcast import BroadcastError, LayoutMismatchError, WeightPlan, apply_weights
from vlmreg.broadcast.adapters import split_modules
from vlmreg.broadcast.plan import lora_modules
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
