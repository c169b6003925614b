"""On a CUDA machine only: varlen (PyTorch's variable-length attention) packs exactly."""

from __future__ import annotations

import pytest
import torch

from tests.train.test_packing import per_sample, reference, setup_family

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
            assert torch.allclose(got.cpu(), alone[i].cpu(), atol=1e-4), (family, i, float((got.cpu() - alone[i].cpu()).abs().max()))


def test_fp32_on_cuda_packs_through_the_per_segment_path():
    import attrs

    import vlmreg
    from vlmreg.config import parse_config

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    loaded, store, samples = setup_family("qwen3_vl", "cuda")
    config = parse_config({"model": {"init": "random", "family": "qwen3_vl", "dtype": "float32"}, "trainer": {"device": "cuda"}})
    torch.manual_seed(0)
    fp32 = vlmreg.load(config)
    fp32.model.eval()
    alone = reference(fp32, store, samples)
    packed = per_sample(fp32, store, samples, packed=True)
    for i in alone:
        assert torch.allclose(packed[i].cpu(), alone[i].cpu(), atol=1e-5)
    del attrs, loaded
