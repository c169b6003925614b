"""A family's vision encoder inputs derived on the host reach every encoder call, and change nothing it computes.

The reference is transformers deriving the same inputs itself inside the encoder's forward (the micro-batch without
them), and each sample alone through the model's own forward (`tests.train.test_packing.reference`).
"""

from __future__ import annotations

import attrs
import pytest
import torch

from tests.train.test_images_across_ranks import family_samples
from tests.train.test_packing import reference
from vlmreg.modeling import vision_calls as vision_calls_module
from vlmreg.modeling.logprobs import selected_logprobs
from vlmreg.modeling.vision_calls import VISION_CALLS, host_vision_inputs
from vlmreg.train.batching import make_microbatches

FAMILIES = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]
#: What transformers' Qwen3-generation encoders pop from their keyword arguments instead of deriving.
PRECOMPUTED = {"interp_indices", "interp_weights", "position_ids", "cu_seqlens", "max_seqlen"}


def logprobs(loaded, microbatches, *, without_calls: bool = False) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for mb in microbatches:
            inputs = {k: v for k, v in mb.inputs.items() if not (without_calls and k == VISION_CALLS)}
            out.append(selected_logprobs(loaded.resolved, inputs, mb.targets, mb.selection)[0])
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, *family_samples(request.param)


def test_every_encoder_call_gets_the_host_inputs_and_the_logprobs_are_transformers_own(family):
    name, loaded, encoder, samples = family
    given: list[set[str]] = []
    spy = loaded.resolved.vision_encoder.register_forward_pre_hook(
        lambda module, args, kwargs: given.append(PRECOMPUTED & set(kwargs)), with_kwargs=True
    )
    try:
        # three micro-batches: images, videos and text alone are split between them
        microbatches = make_microbatches(
            samples, loaded.resolved, encoder, budget=max(len(s) for s in samples) * 2, packed=True, device="cpu"
        )
        assert len(microbatches) > 1
        ours = logprobs(loaded, microbatches)
        calls = len(given)
        derived = logprobs(loaded, microbatches, without_calls=True)
    finally:
        spy.remove()
    kinds = [set(mb.inputs.get(VISION_CALLS, {})) for mb in microbatches]
    media = {k for mb in microbatches for k in mb.inputs if k.endswith("grid_thw")}
    assert set().union(*kinds) == media  # images, and videos where the family takes them
    assert calls == sum(len(k) for k in kinds) > 0
    assert all(g == PRECOMPUTED for g in given[:calls])  # every call got all five
    assert not any(given[calls:])  # and without them, the encoder derived its own
    for got, want in zip(ours, derived, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # each sample alone through the model's own forward, as the processor encodes it
    alone = reference(loaded, encoder, samples)
    padded = make_microbatches(samples, loaded.resolved, encoder, budget=10**6, packed=False, device="cpu")[0]
    got = logprobs(loaded, [padded])[0]
    owner = padded.sample_index[padded.loss_mask]
    for i, want in alone.items():
        torch.testing.assert_close(got[owner == i], want, atol=1e-5, rtol=1e-5)


def test_the_host_inputs_are_what_the_encoder_uses(family):
    """Weights of the position grid's taps altered on the host change the logprobs: the encoder took them."""
    name, loaded, encoder, samples = family

    def altered(vision_encoder, image_inputs):
        out = loaded.resolved.descriptor.vision_call_inputs(vision_encoder, image_inputs)
        return {k: {**v, "interp_weights": v["interp_weights"].flip(-1)} for k, v in out.items()}

    bent = attrs.evolve(
        loaded.resolved, descriptor=attrs.evolve(loaded.resolved.descriptor, vision_call_inputs=altered)
    )
    first = [s for s in samples if s.image_ids][:1]
    right = make_microbatches(first, loaded.resolved, encoder, budget=4096, packed=True, device="cpu")
    wrong = make_microbatches(first, bent, encoder, budget=4096, packed=True, device="cpu")
    assert not torch.allclose(logprobs(loaded, right)[0], logprobs(loaded, wrong)[0])


def test_inputs_that_reach_no_encoder_call_are_named_in_a_warning(family, monkeypatch):
    """A model that hands its encoder a copy of the grid (as another transformers version might) gets nothing added:
    the encoder derives its inputs itself, and a warning says so once."""
    name, loaded, encoder, samples = family
    monkeypatch.setattr(vision_calls_module, "_WARNED", set())
    base = loaded.model.model
    real = base.get_image_features
    monkeypatch.setattr(base, "get_image_features", lambda pixels, grid, **kw: real(pixels, grid.clone(), **kw))
    first = [s for s in samples if s.image_ids][:1]
    mb = make_microbatches(first, loaded.resolved, encoder, budget=4096, packed=True, device="cpu")[0]
    with pytest.warns(RuntimeWarning, match=rf"family {name}: its vision_call_inputs reached no call.*image_grid_thw"):
        got = logprobs(loaded, [mb])[0]
    torch.testing.assert_close(got, logprobs(loaded, [mb], without_calls=True)[0], rtol=0, atol=0)


def test_a_hook_that_names_no_image_input_is_refused(family):
    name, loaded, encoder, samples = family
    bent = attrs.evolve(
        loaded.resolved,
        descriptor=attrs.evolve(loaded.resolved.descriptor, vision_call_inputs=lambda e, i: {"pixels": {}}),
    )
    with pytest.raises(TypeError, match=rf"family {name}: vision_call_inputs must map names of the image inputs"):
        host_vision_inputs(bent, {"image_grid_thw": torch.tensor([[1, 4, 4]])})
