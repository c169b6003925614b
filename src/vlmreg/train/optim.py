"""AdamW whose updates to 16-bit weights are not lost to rounding: `CompensatedAdamW`.

RL fine-tuning runs at learning rates around 1e-6. A bf16 weight of size 0.02 has a spacing of about 1.2e-4 between
representable values, so an AdamW step of about ``lr`` (each Adam step moves a weight by at most about ``lr``) is
rounded away entirely when it is added to the weight: with plain ``torch.optim.AdamW`` on bf16 parameters, most
weights never move. The usual cure is an fp32 master copy of every weight (4 more bytes per parameter, and fp32
moments, 8 more). This optimizer keeps a 16-bit compensation buffer per 16-bit parameter instead (2 bytes per
parameter; Kahan summation): each step adds the update plus the rounding error carried from earlier steps, and
carries the new rounding error forward, so small updates accumulate exactly as they would in fp32 until they move
the weight. The Adam moments stay in the parameter's dtype (as ``torch.optim.AdamW`` keeps them), the arithmetic of
a step is fp32, and parameters that are already fp32 get plain AdamW. The step is decoupled weight decay AdamW
(Loshchilov & Hutter), the same formula as ``torch.optim.AdamW``; the state's names (``step``, ``exp_avg``,
``exp_avg_sq``) are torch's, so checkpoints of either load into the other (the compensation starts at zero).

A sharded parameter (FSDP2's DTensor) is stepped on this rank's shard, as a plain tensor. On a GPU each parameter's
step is one Triton kernel of the same arithmetic (the step's scalars in a small device
tensor): it reads the weight, gradient, moments and compensation once and writes them once, where the eager
arithmetic makes about 25 passes with fp32 temporaries. Triton rounds exactly where the kernel casts, which the
compensation depends on (``torch.compile`` of the eager code kept fp32 through the casts in its fused kernel, and
every compensation came out zero). ``VLMREG_COMPILED_OPTIMIZER=0`` keeps the eager arithmetic.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["CompensatedAdamW"]

#: Elements per piece of a large parameter, so the fp32 temporaries of a step stay small (an embedding of 151,936 x
#: 2,048 is processed in 5 pieces of at most 64M elements, 256 MB each in fp32).
PIECE = 64 * 1024 * 1024
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


class CompensatedAdamW(torch.optim.Optimizer):
    """AdamW with Kahan-compensated updates of 16-bit parameters (see the module's docstring)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW settings: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        on_device: dict[tuple, torch.Tensor] = {}
        for group in self.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CompensatedAdamW does not take sparse gradients")
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if p.dtype in _SIXTEEN_BIT and "compensation" not in state:
                    state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                scale = lr / (1 - beta1**step)
                root_correction = (1 - beta2**step) ** 0.5
                tensors = [p, p.grad, state["exp_avg"], state["exp_avg_sq"]] + (
                    [state["compensation"]] if "compensation" in state else []
                )
                scalars = (lr, beta1, beta2, eps, decay, scale, root_correction)
                tensors = _local(tensors)
                if (
                    p.is_cuda
                    and _kernel() is not None
                    and all(t.is_contiguous() and not hasattr(t, "to_local") for t in tensors)
                ):
                    key = (p.device, scalars)
                    if key not in on_device:  # one small copy per step and device, not per parameter
                        on_device[key] = _device_scalars(*scalars, p.device)
                    _kernel_step(tensors, on_device[key])
                    continue
                for piece in zip(*(_pieces(t, _splittable(tensors)) for t in tensors), strict=True):
                    weight, grad, exp_avg, exp_avg_sq, *compensation = piece
                    _update(weight, grad, exp_avg, exp_avg_sq, compensation[0] if compensation else None, *scalars)
        return loss


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A sharded (FSDP2) parameter's step is elementwise on this rank's shard: the shards of the weight, its gradient
    and its state (laid out alike, ``zeros_like`` of the weight), so the kernel and the piecewise step take them as
    plain tensors. Anything else (a DTensor whose pieces differ in size) stays as it is."""
    if not all(hasattr(t, "to_local") for t in tensors):
        return tensors
    sharded: list[Any] = list(tensors)  # DTensors (torch types them as Tensor here)
    local = [t.to_local() for t in sharded]
    if len({t.numel() for t in local}) != 1 or len({tuple(t.placements) for t in sharded}) != 1:
        return tensors
    return local


def _splittable(tensors: list[torch.Tensor]) -> bool:
    """Whether a parameter and its state are large, plain and contiguous, so a step can go piece by piece (a DTensor
    shard, or anything not contiguous, is stepped whole)."""
    return tensors[0].numel() > PIECE and all(t.is_contiguous() and not hasattr(t, "to_local") for t in tensors)


def _pieces(tensor: torch.Tensor, split: bool) -> list[torch.Tensor]:
    """Views of ``tensor`` in pieces of at most `PIECE` elements, or the tensor whole."""
    return list(tensor.view(-1).split(PIECE)) if split else [tensor]


def _update(
    weight: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    compensation: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    decay: float,
    scale: float,
    root_correction: float,
) -> None:
    """One AdamW step of one piece, in fp32: moments, then ``w - lr * wd * w - scale * m / (sqrt(v) / c2 + eps)``."""
    g = grad.float()
    m = exp_avg.float().lerp_(g, 1 - beta1)  # fp32 moments are updated in place (.float() of fp32 is no copy)
    v = exp_avg_sq.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    w = weight.float()
    delta = (m / v.sqrt().div_(root_correction).add_(eps)).mul_(-scale)
    if decay:
        delta.add_(w, alpha=-lr * decay)
    if compensation is None:
        weight.copy_(w.add_(delta))
        return
    delta.add_(compensation.float())  # the rounding error carried from earlier steps
    weight.copy_(w + delta)
    compensation.copy_(delta.sub_(weight.float().sub_(w)))  # what rounding to the weight's dtype lost this time


@functools.cache
def _kernel() -> Any:
    """The Triton kernel of one parameter's step (`_update`'s arithmetic, one read and one write of each tensor), or
    ``None`` when turned off (``VLMREG_COMPILED_OPTIMIZER=0``) or Triton is missing."""
    if os.environ.get("VLMREG_COMPILED_OPTIMIZER", "1") == "0":
        return None
    try:
        # deferred: fails to import here (ModuleNotFoundError: No module named 'triton')
        import triton  # noqa: PLC0415
        import triton.language as tl  # noqa: PLC0415
    except ImportError:
        return None

    @triton.jit
    def step(
        weight, grad, exp_avg, exp_avg_sq, compensation, scalars, n, COMPENSATED: tl.constexpr, BLOCK: tl.constexpr
    ):  # noqa: N803
        lanes = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = lanes < n
        one_minus_beta1, beta2, one_minus_beta2 = tl.load(scalars), tl.load(scalars + 1), tl.load(scalars + 2)
        eps, lr_decay, scale, root_correction = (
            tl.load(scalars + 3),
            tl.load(scalars + 4),
            tl.load(scalars + 5),
            tl.load(scalars + 6),
        )
        g = tl.load(grad + lanes, mask=keep).to(tl.float32)
        m = tl.load(exp_avg + lanes, mask=keep).to(tl.float32)
        m = m + one_minus_beta1 * (g - m)  # torch's lerp for weights below 0.5
        v = tl.load(exp_avg_sq + lanes, mask=keep).to(tl.float32) * beta2 + g * g * one_minus_beta2
        tl.store(exp_avg + lanes, m.to(exp_avg.dtype.element_ty, fp_downcast_rounding="rtne"), mask=keep)
        tl.store(exp_avg_sq + lanes, v.to(exp_avg_sq.dtype.element_ty, fp_downcast_rounding="rtne"), mask=keep)
        w = tl.load(weight + lanes, mask=keep).to(tl.float32)
        delta = tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), root_correction) + eps) * -scale - w * lr_decay
        if COMPENSATED:
            delta = delta + tl.load(compensation + lanes, mask=keep).to(tl.float32)
            # Triton rounds where it casts
            rounded = (w + delta).to(weight.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(weight + lanes, rounded, mask=keep)
            tl.store(
                compensation + lanes,
                (delta - (rounded.to(tl.float32) - w)).to(compensation.dtype.element_ty, fp_downcast_rounding="rtne"),
                mask=keep,
            )
        else:
            tl.store(weight + lanes, (w + delta).to(weight.dtype.element_ty, fp_downcast_rounding="rtne"), mask=keep)

    return step


#: Elements a program of the kernel steps.
KERNEL_BLOCK = 2048


def _kernel_step(tensors: list[torch.Tensor], scalars: torch.Tensor) -> None:
    """One parameter's step by the kernel (``tensors``: weight, grad, moments, compensation or not, all contiguous)."""
    weight = tensors[0]
    n = weight.numel()
    compensation = tensors[4] if len(tensors) > 4 else weight  # not read without COMPENSATED
    _kernel()[(-(-n // KERNEL_BLOCK),)](
        *tensors[:4], compensation, scalars, n, COMPENSATED=len(tensors) > 4, BLOCK=KERNEL_BLOCK
    )


def _device_scalars(
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    decay: float,
    scale: float,
    root_correction: float,
    device: torch.device,
) -> torch.Tensor:
    """The kernel's scalars, each computed in double as the eager step's Python floats are, on ``device``."""
    values = (1 - beta1, beta2, 1 - beta2, eps, lr * decay, scale, root_correction)
    return torch.tensor(values, dtype=torch.float32).pin_memory().to(device, non_blocking=True)
