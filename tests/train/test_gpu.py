"""On a CUDA machine only: varlen (PyTorch's variable-length attention) packs exactly."""

from __future__ import annotations

import pytest
import torch

import vlmreg
from tests.train.test_packing import per_sample, reference, setup_family
from vlmreg.config import parse_config
from vlmreg.modeling import logprobs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_varlen_packing_matches_each_sample_alone_on_cuda(family):
    """In bf16 the varlen kernel (FlashAttention) runs; in fp32 the per-segment path does (see the next test)."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    loaded, store, samples = setup_family(family, "cuda")
    assert loaded.device.type == "cuda" and loaded.model.config._attn_implementation == "vlmreg_varlen"
    alone = reference(loaded, store, samples)
    packed = per_sample(loaded, store, samples, packed=True)
    padded = per_sample(loaded, store, samples, packed=False)
    for i in alone:
        for got in (packed[i], padded[i]):
            assert torch.allclose(got.cpu(), alone[i].cpu(), atol=1e-4), (
                family,
                i,
                float((got.cpu() - alone[i].cpu()).abs().max()),
            )


def test_fp32_on_cuda_packs_through_the_per_segment_path():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    loaded, store, samples = setup_family("qwen3_vl", "cuda")
    config = parse_config(
        {"model": {"init": "random", "family": "qwen3_vl", "dtype": "float32"}, "trainer": {"device": "cuda"}}
    )
    torch.manual_seed(0)
    fp32 = vlmreg.load(config)
    fp32.model.eval()
    alone = reference(fp32, store, samples)
    packed = per_sample(fp32, store, samples, packed=True)
    for i in alone:
        assert torch.allclose(packed[i].cpu(), alone[i].cpu(), atol=1e-5)
    del loaded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled logprob passes are for GPUs")
def test_compiled_logprob_passes_equal_the_eager_ones(monkeypatch):
    """The head's chunk on a GPU: compiled reductions give the eager passes' logprobs, entropies and gradients (bf16
    head, a temperature, banned tokens)."""

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(700, 256, device="cuda", generator=g).bfloat16()
    weight = (0.1 * torch.randn(5000, 256, device="cuda", generator=g)).bfloat16()
    targets = torch.randint(0, 5000, (700,), device="cuda", generator=g)
    for token in (3, 17, 4999):  # a banned token is never a target
        targets[targets == token] = 18
    banned = logprobs._suppressed((3, 17, 4999), torch.device("cuda"), 5000)
    upstream = torch.linspace(-1, 1, 700, device="cuda")
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("VLMREG_COMPILED_LOGPROBS", flag)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, entropy = logprobs._ChunkLogprob.apply(h, w, None, targets, 0.7, banned)
        (logp * upstream).sum().backward()
        results[flag] = (logp.detach(), entropy, h.grad.float(), w.grad.float())
    for compiled, eager in zip(results["1"], results["0"], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=1e-3)
    assert bool(torch.isfinite(results["1"][0]).all()) and float(results["0"][3][[3, 17, 4999]].abs().max()) == 0.0
    # the independent reference: the head's logits through torch's own log_softmax and autograd
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = (torch.nn.functional.linear(h, w).float() / 0.7).masked_fill(banned, float("-inf"))
    plain = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    (plain * upstream).sum().backward()
    for ours, theirs in zip(
        results["1"][:1] + results["1"][2:], (plain.detach(), h.grad.float(), w.grad.float()), strict=True
    ):
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=1e-3)
