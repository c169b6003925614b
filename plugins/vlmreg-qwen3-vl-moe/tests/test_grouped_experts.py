"""The Qwen MoE families' grouped experts (`vlmreg_qwen_common.grouped_experts`) equal transformers' eager expert
loop, in fp32: per-token logprobs of the tiny MoE models and the gradient of every parameter (experts, routers,
attention, embeddings).

The reference is transformers' own ``experts_implementation="eager"`` (a Python loop over the experts, each a pair
of ``F.linear``), on a copy of the same weights, differentiated by autograd.
"""

from __future__ import annotations

import copy

import pytest
import torch
from vlmreg_qwen_common.grouped_experts import (
    GROUPED,
    experts_implementations,
    grouped_experts_forward,
    use_grouped_experts,
)

import vlmreg
from vlmreg.testing import tiny_model

MOE_FAMILIES = ["qwen3_vl_moe", "qwen3_5_moe"]


def logprob_loss(model, ids, targets, weights):
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    return logp, (logp * weights).sum()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_grouped_experts_equal_the_eager_loop(family):
    eager = tiny_model(family, seed=0).float()
    ours = copy.deepcopy(eager)
    eager.set_experts_implementation("eager")
    assert use_grouped_experts(ours) == GROUPED
    assert experts_implementations(ours) == {GROUPED} and experts_implementations(eager) == {"eager"}
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 1000, (3, 17), generator=generator)
    targets = torch.randint(10, 1000, (3, 17), generator=generator)
    weights = torch.randn(3, 17, generator=generator)
    logp_ref, loss_ref = logprob_loss(eager, ids, targets, weights)
    logp, loss = logprob_loss(ours, ids, targets, weights)
    torch.testing.assert_close(logp, logp_ref, rtol=1e-5, atol=1e-5)
    loss_ref.backward()
    loss.backward()
    checked = 0
    for (name, p_ref), (_, p) in zip(eager.named_parameters(), ours.named_parameters(), strict=True):
        if p_ref.grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        checked += "experts" in name or "gate.weight" in name
    assert checked >= 2 * 3  # each layer's gate_up_proj, down_proj and router got a gradient


def test_an_expert_without_tokens_and_uneven_loads():
    """Routing that leaves expert 0 empty and gives expert 3 most pairs: the grouped GEMMs' empty and long groups."""
    model = tiny_model("qwen3_vl_moe", seed=0).float()
    experts = vlmreg.resolve(model).layers[0].mlp.experts
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(11, experts.hidden_dim, generator=generator, requires_grad=True)
    index = torch.tensor([[3, 1]] * 6 + [[3, 2]] * 4 + [[2, 1]])
    weights = torch.rand(11, 2, generator=generator).requires_grad_()
    model.set_experts_implementation("eager")
    reference = experts(hidden, index, weights)
    grads_ref = torch.autograd.grad((reference**2).sum(), (hidden, weights, experts.gate_up_proj, experts.down_proj))
    out = grouped_experts_forward(experts, hidden, index, weights)
    grads = torch.autograd.grad((out**2).sum(), (hidden, weights, experts.gate_up_proj, experts.down_proj))
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    for grad, grad_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-6)
    assert grads[2][0].abs().sum() == 0  # the empty expert gets no gradient


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_prepare_model_switches_the_moe_families_to_grouped_experts(family):
    model = tiny_model(family, seed=0)
    assert experts_implementations(model) == {"grouped_mm"}  # transformers' default
    vlmreg.get_registry().get(family).prepare_model(model)
    assert experts_implementations(model) == {GROUPED}


def test_a_dense_model_has_no_experts_to_switch():
    assert use_grouped_experts(tiny_model("qwen3_vl", seed=0)) is None


def test_in_bf16_the_grouped_experts_stay_close_to_the_fp32_loop():
    """The GPU's dtype (on CPU): bf16 weights and activations, within bf16 rounding of transformers' fp32 loop."""
    model = tiny_model("qwen3_vl_moe", seed=0).float()
    experts = vlmreg.resolve(model).layers[0].mlp.experts
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(32, experts.hidden_dim, generator=generator)
    index = torch.stack([torch.randperm(experts.num_experts, generator=generator)[:2] for _ in range(32)])
    weights = torch.rand(32, 2, generator=generator)
    model.set_experts_implementation("eager")
    reference = experts(hidden, index, weights)
    low = copy.deepcopy(experts).to(torch.bfloat16)
    out = grouped_experts_forward(low, hidden.bfloat16(), index, weights.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, rtol=3e-2, atol=3e-2 * reference.abs().max().item())
