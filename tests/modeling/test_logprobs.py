"""Chunked per-token logprobs and entropy equal the model's own full logits, values and gradients.

The reference is a plain forward of the tiny model (all logits, transformers' head), ``log_softmax`` over the
temperature-scaled logits with suppressed tokens at -inf, and torch's own ``Categorical.entropy``; gradients are
autograd's through that reference. Chunks smaller than the selection make the chunking itself part of the check.
"""

from __future__ import annotations

import attrs
import pytest
import torch

import vlmreg
from vlmreg.modeling.attention import _PACKED
from vlmreg.modeling.logprobs import _ChunkLogprob, hidden_states, selected_logprobs, token_entropy
from vlmreg.testing import tiny_model

SUPPRESS = (5, 6, 17)


@pytest.fixture(scope="module")
def case():
    resolved = vlmreg.resolve(tiny_model("qwen3_vl", seed=0).float())
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (2, 9), generator=generator)
    targets = torch.randint(10, 1000, (2, 9), generator=generator)
    targets[0, 3] = 17  # a suppressed target: log p = -inf, as in the sampler
    select = torch.zeros(2, 9, dtype=torch.bool)
    select[0, 2:7] = True
    select[1, 1:9] = True
    return resolved, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, targets, select


def reference(resolved, inputs, targets, select, temperature, suppress):
    logits = resolved.model(**inputs, use_cache=False).logits.float() / temperature
    if suppress:
        logits = logits.index_fill(-1, torch.tensor(suppress), float("-inf"))
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)[select]
    entropy = torch.distributions.Categorical(logits=logits[select]).entropy()
    return logp, entropy


def grads(resolved, value: torch.Tensor) -> dict[str, torch.Tensor]:
    model = resolved.model
    model.zero_grad()
    value.backward()
    wanted = (
        "lm_head.weight",
        "model.language_model.norm.weight",
        "model.language_model.layers.1.mlp.down_proj.weight",
    )
    return {n: p.grad.clone() for n, p in model.named_parameters() if n in wanted}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("suppress", [(), SUPPRESS])
@pytest.mark.parametrize("flat", [False, True])
def test_values_and_gradients_equal_the_full_logits(case, temperature, suppress, flat):
    resolved, inputs, targets, select = case
    weights = torch.linspace(0.5, 1.5, int(select.sum()))
    ref_logp, ref_entropy = reference(resolved, inputs, targets, select, temperature, suppress)
    finite = torch.isfinite(ref_logp)
    assert bool(finite.all()) == (not suppress)
    expected = grads(resolved, (ref_logp[finite] * weights[finite]).sum())
    where = select.flatten().nonzero().squeeze(1) if flat else select
    logp, entropy = selected_logprobs(
        resolved, inputs, targets, where, temperature=temperature, suppress=suppress, chunk_tokens=3
    )
    assert logp.shape == ref_logp.shape and entropy.shape == ref_entropy.shape
    assert torch.equal(torch.isfinite(logp), finite)
    torch.testing.assert_close(logp[finite], ref_logp[finite], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    assert not entropy.requires_grad
    got = grads(resolved, (logp[finite] * weights[finite]).sum())
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_entropy_gradient_equals_the_full_logits_when_asked(case):
    resolved, inputs, targets, select = case
    _, ref_entropy = reference(resolved, inputs, targets, select, 0.8, SUPPRESS)
    expected = grads(resolved, ref_entropy.sum())
    _, entropy = selected_logprobs(
        resolved, inputs, targets, select, temperature=0.8, suppress=SUPPRESS, chunk_tokens=4, entropy_grad=True
    )
    torch.testing.assert_close(entropy.detach(), ref_entropy.detach(), atol=1e-5, rtol=1e-5)
    got = grads(resolved, entropy.sum())
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_nothing_selected_gives_empty_results(case):
    resolved, inputs, targets, select = case
    logp, entropy = selected_logprobs(resolved, inputs, targets, torch.zeros_like(select))
    assert logp.shape == (0,) and entropy.shape == (0,) and logp.dtype == torch.float32


def test_hidden_states_are_the_base_models_last_hidden_state(case):
    resolved, inputs, _, _ = case
    with torch.no_grad():
        expected = resolved.model.model(**inputs, use_cache=False).last_hidden_state
        got = hidden_states(resolved, inputs)
    assert torch.equal(got, expected)


def test_a_head_with_a_bias_and_its_gradients():
    """The chunk function with a bias (no tiny family has one): against ``F.linear`` + ``log_softmax`` under
    autograd."""
    torch.manual_seed(0)
    hidden = torch.randn(7, 8, requires_grad=True)
    head = torch.nn.Linear(8, 11)
    targets = torch.randint(0, 11, (7,))
    banned = torch.zeros(11, dtype=torch.bool)
    banned[[2, 9]] = True
    targets[targets == 2] = 3
    targets[targets == 9] = 3
    logits = (torch.nn.functional.linear(hidden, head.weight, head.bias) / 1.3).masked_fill(banned, float("-inf"))
    ref = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    expected = torch.autograd.grad((ref * torch.arange(7.0)).sum(), (hidden, head.weight, head.bias))
    logp, entropy = _ChunkLogprob.apply(hidden, head.weight, head.bias, targets, 1.3, banned)
    torch.testing.assert_close(logp, ref)
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=logits).entropy())
    got = torch.autograd.grad((logp * torch.arange(7.0)).sum(), (hidden, head.weight, head.bias))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    with_grad = token_entropy(hidden, head.weight, head.bias, 1.3, torch.tensor([2, 9]))
    torch.testing.assert_close(with_grad, torch.distributions.Categorical(logits=logits).entropy())


def test_a_head_that_is_not_linear_is_refused(case):
    resolved, inputs, targets, select = case
    odd = attrs.evolve(resolved, lm_head=torch.nn.Bilinear(2, 2, 2))
    with pytest.raises(TypeError, match="the resolved lm_head is a Bilinear; chunked logprobs need a linear head"):
        selected_logprobs(odd, inputs, targets, select)


def test_nothing_selected_is_float32_whatever_the_models_dtype():
    resolved = vlmreg.resolve(tiny_model("qwen3_vl", seed=0).to(torch.bfloat16))
    ids = torch.randint(10, 1000, (1, 5))
    logp, entropy = selected_logprobs(resolved, {"input_ids": ids}, ids, torch.zeros(1, 5, dtype=torch.bool))
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == (0,)


def test_a_base_model_that_runs_twice_is_an_error_naming_it(case):
    """The last hidden states are captured by a hook on ``model.base_model``; a forward that calls it twice is
    refused."""
    resolved, inputs, _, _ = case

    class Twice(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        @property
        def base_model(self):
            return self.inner.model

        def forward(self, **kwargs):
            self.inner(**kwargs)
            return self.inner(**kwargs)

    twice = attrs.evolve(resolved, model=Twice(resolved.model))
    with pytest.raises(RuntimeError, match=f"expected one output from {type(resolved.model.model).__name__}, got 2"):
        hidden_states(twice, inputs)


def test_a_frozen_head_still_passes_the_gradient_to_the_hidden_states_at_temperature_two():
    """LoRA trains the model under a frozen head: the chunk function must send the gradient to the hidden states
    when only they need it. Against ``F.linear`` + ``log_softmax`` under autograd, at a temperature of 2."""
    torch.manual_seed(1)
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(13, 8)  # frozen
    targets = torch.randint(0, 13, (6,))
    ref = torch.log_softmax(torch.nn.functional.linear(hidden, weight) / 2.0, -1).gather(-1, targets[:, None])[:, 0]
    (expected,) = torch.autograd.grad((ref * torch.arange(1.0, 7.0)).sum(), (hidden,))
    logp, _ = _ChunkLogprob.apply(hidden, weight, None, targets, 2.0, None)
    torch.testing.assert_close(logp, ref)
    (got,) = torch.autograd.grad((logp * torch.arange(1.0, 7.0)).sum(), (hidden,))
    torch.testing.assert_close(got, expected)


def test_a_bfloat16_head_gets_bfloat16_gradients_close_to_float32_autograd():
    torch.manual_seed(2)
    hidden = torch.randn(5, 8, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 11, (5,))
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = torch.log_softmax(torch.nn.functional.linear(h32, w32), -1).gather(-1, targets[:, None])[:, 0]
    expected = torch.autograd.grad(ref.sum(), (h32, w32))
    logp, _ = _ChunkLogprob.apply(hidden, weight, None, targets, 1.0, None)
    got = torch.autograd.grad(logp.sum(), (hidden, weight))
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), e, atol=3e-2, rtol=3e-2)


def test_token_entropy_at_its_default_temperature_and_its_gradient_by_autograd_grad():
    """``token_entropy`` without a temperature is the head's own distribution's entropy (``Categorical``), and its
    gradient can be taken with ``torch.autograd.grad`` as well as ``backward`` (non-reentrant recomputation)."""
    torch.manual_seed(3)
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(9, 8, requires_grad=True)
    logits = torch.nn.functional.linear(hidden, weight)
    ref = torch.distributions.Categorical(logits=logits).entropy()
    expected = torch.autograd.grad(ref.sum(), (hidden, weight))
    got_value = token_entropy(hidden, weight, None)
    torch.testing.assert_close(got_value, ref)
    got = torch.autograd.grad(got_value.sum(), (hidden, weight))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_each_calls_suppressed_tokens_are_its_own(case):
    """Two suppressed sets one after the other: the second call must not reuse the first's (a cached tensor)."""
    resolved, inputs, targets, select = case
    for suppress in ((5, 6, 17), (40, 41)):
        ref_logp, ref_entropy = reference(resolved, inputs, targets, select, 1.0, suppress)
        with torch.no_grad():
            logp, entropy = selected_logprobs(resolved, inputs, targets, select, suppress=suppress)
        assert torch.equal(torch.isfinite(logp), torch.isfinite(ref_logp))
        torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)


class _Wrapper(torch.nn.Module):
    """A model whose base model is ``base``; records whether packed-row attention was on during its forward."""

    def __init__(self, inner, base):
        super().__init__()
        self.inner, self.base, self.packed = inner, base, []

    @property
    def base_model(self):
        return self.base

    def forward(self, **kwargs):
        self.packed.append(_PACKED.get())
        kwargs.pop("cu_seq_lens_q", None)
        return self.inner(**kwargs)


def test_a_base_model_that_returns_a_tuple_gives_its_first_element(case):
    resolved, inputs, _, _ = case

    class AsTuple(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            kwargs.pop("logits_to_keep", None)
            out = self.inner(**kwargs)
            return (out.last_hidden_state, None)

    base = AsTuple(resolved.model.model)
    wrapped = attrs.evolve(resolved, model=_Wrapper(base, base))
    with torch.no_grad():
        expected = resolved.model.model(**inputs, use_cache=False).last_hidden_state
        assert torch.equal(hidden_states(wrapped, inputs), expected)


def test_packed_inputs_and_only_they_run_with_packed_row_attention(case):
    resolved, inputs, _, _ = case
    wrapper = _Wrapper(resolved.model, resolved.model.model)
    wrapped = attrs.evolve(resolved, model=wrapper)
    with torch.no_grad():
        hidden_states(wrapped, inputs)
        hidden_states(wrapped, {**inputs, "cu_seq_lens_q": torch.tensor([0, 9, 18])})
    assert wrapper.packed == [False, True]


def test_the_models_own_head_computes_no_logits(case):
    """The forward runs with ``logits_to_keep`` empty: the head's output has no positions (the logits are computed
    only in chunks, by vlmreg)."""
    resolved, inputs, targets, select = case
    shapes = []
    handle = resolved.model.lm_head.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    try:
        with torch.no_grad():
            selected_logprobs(resolved, inputs, targets, select)
    finally:
        handle.remove()
    assert shapes == [(2, 0, resolved.model.lm_head.out_features)]


def test_a_biased_head_of_a_class_named_linear_against_f_linear(case):
    """A head that is not ``torch.nn.Linear`` but a class named ``Linear`` (as peft's) is accepted, and its bias is
    used in the logprobs, the entropy and the entropy's gradient; more tokens than the hidden size, in chunks."""
    resolved, inputs, _, _ = case

    class Linear(torch.nn.Module):
        def __init__(self, weight, bias):
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)

    torch.manual_seed(4)
    vocab = resolved.model.lm_head.out_features
    head = Linear(resolved.model.lm_head.weight.detach().clone(), torch.randn(vocab))
    ids = torch.randint(10, 1000, (2, 45))
    targets = torch.randint(10, 1000, (2, 45))
    select = torch.ones(2, 45, dtype=torch.bool)  # 90 tokens, more than the hidden size (64)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        hidden = hidden_states(resolved, batch)[select]
    logits = torch.nn.functional.linear(hidden, head.weight, head.bias)
    ref_logp = torch.log_softmax(logits, -1).gather(-1, targets[select][:, None])[:, 0]
    ref_entropy = torch.distributions.Categorical(logits=logits).entropy()
    (expected,) = torch.autograd.grad(ref_entropy.sum(), (head.bias,))
    biased = attrs.evolve(resolved, lm_head=head)
    logp, entropy = selected_logprobs(biased, batch, targets, select, chunk_tokens=16, entropy_grad=True)
    torch.testing.assert_close(logp.detach(), ref_logp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.detach(), ref_entropy.detach(), atol=1e-5, rtol=1e-5)
    (got,) = torch.autograd.grad(entropy.sum(), (head.bias,))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
