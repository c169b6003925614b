"""The vision patch embedding as a matmul (`vlmreg_qwen_common.patch_embed`) computes what transformers' own Conv3d
does, for every Qwen family, and every Qwen family's ``prepare_model`` switches to it.

The reference is the family's own patch-embedding module, run unchanged on the same weights and pixels: output and
the gradients of its weight and bias, in float64 (the two sum the same products in another order) and in bf16 on a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from vlmreg_qwen_common.patch_embed import patch_embed_as_matmul

from vlmreg.sdk.registry import get_registry
from vlmreg.testing import tiny_model

QWEN = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]


def run(module: torch.nn.Module, pixels: torch.Tensor) -> list[torch.Tensor]:
    """The output, and the gradient of each of ``proj``'s parameters (Qwen2-VL's has no bias)."""
    module.zero_grad(set_to_none=True)
    out = module(pixels)
    (out.float().sin().sum()).backward()
    return [out.detach(), *(p.grad.clone() for p in module.proj.parameters())]


@pytest.mark.parametrize("family", QWEN)
def test_the_matmul_equals_the_family_s_own_conv3d_in_float64(family):
    own = tiny_model(family).model.visual.patch_embed.double()
    proj = own.proj
    torch.manual_seed(0)
    pixels = torch.randn(37, proj.in_channels * proj.weight[0, 0].numel(), dtype=torch.float64)
    matmul = copy.deepcopy(own)
    assert patch_embed_as_matmul(torch.nn.ModuleDict({"patch_embed": matmul})) == 1
    for want, got in zip(run(own, pixels), run(matmul, pixels), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_matmul_equals_the_conv3d_in_bf16_on_a_gpu():
    own = tiny_model("qwen3_vl").model.visual.patch_embed.to("cuda", torch.bfloat16)
    pixels = torch.randn(4096, own.proj.weight[0].numel(), device="cuda")
    matmul = copy.deepcopy(own)
    patch_embed_as_matmul(torch.nn.ModuleDict({"patch_embed": matmul}))
    for want, got in zip(run(own, pixels), run(matmul, pixels), strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("family", QWEN)
def test_every_qwen_family_s_prepare_model_runs_the_patch_embedding_without_the_conv3d(family, monkeypatch):
    model = tiny_model(family)
    names = [n for n, _ in model.named_parameters()]
    get_registry().get(family).prepare_model(model)

    def refused(self, x):
        raise AssertionError("the Conv3d ran")

    monkeypatch.setattr(torch.nn.Conv3d, "forward", refused)
    embed = model.model.visual.patch_embed
    out = embed(torch.randn(5, embed.proj.weight[0].numel()))
    assert out.shape == (5, embed.proj.out_channels)
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints, LoRA targets and syncs unchanged


def test_a_convolution_that_is_not_a_patchify_is_left_alone():
    embed = torch.nn.Module()
    embed.proj = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(1, 2, 2))
    assert patch_embed_as_matmul(torch.nn.ModuleDict({"patch_embed": embed})) == 0
