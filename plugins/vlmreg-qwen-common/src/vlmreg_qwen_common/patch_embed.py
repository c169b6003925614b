"""The vision patch embedding as the matmul it is, with the model's own weight.

Every Qwen vision tower (Qwen2-VL to Qwen3.5) embeds its patches with an ``nn.Conv3d`` whose kernel equals its stride
and whose input is one patch: each output is the patch's flattened pixels times the kernel, a matmul. cuDNN has no
good algorithm for that shape on every GPU and dtype: transformers issue #45750 reports it about 50,000x slower than
the matmul on Blackwell in bf16, sglang and vLLM run it as a linear layer, and transformers added a fusion that
replaces the module. `patch_embed_as_matmul` keeps the module and its ``proj`` (names, checkpoints, LoRA targets,
the weight sync unchanged) and gives it a forward that multiplies the flattened patches by ``proj.weight`` viewed as
a matrix, so gradients reach the same parameter.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["patch_embed_as_matmul"]


def _matmul_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self.proj.weight
    patches = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
    return F.linear(patches, weight.reshape(weight.shape[0], -1), self.proj.bias).view(-1, weight.shape[0])


def _is_patchify(proj: Any) -> bool:
    """A Conv3d that sees each patch once and whole (no overlap, padding, dilation or groups)."""
    return (
        isinstance(proj, nn.Conv3d)
        and tuple(proj.stride) == tuple(proj.kernel_size)
        and tuple(proj.padding) == (0, 0, 0)
        and tuple(proj.dilation) == (1, 1, 1)
        and proj.groups == 1
    )


def patch_embed_as_matmul(model: nn.Module) -> int:
    """Give each patch embedding of ``model`` (a module named ``patch_embed`` whose ``proj`` is a patchify Conv3d) the
    matmul forward; returns how many it changed (0 leaves the model as it was)."""
    changed = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "patch_embed" and _is_patchify(getattr(module, "proj", None)):
            module.forward = types.MethodType(_matmul_forward, module)  # this instance's: the class keeps its own
            changed += 1
    return changed
