"""Routed experts in two grouped matmuls: ``vlmreg_grouped``, registered with transformers' experts interface.

transformers 5 stores a MoE layer's routed experts as two fused 3-D parameters and picks their forward through
``config._experts_implementation`` (``@use_experts_implementation``): ``eager`` loops over the experts in Python,
``batched_mm`` gathers a weight copy per (token, expert) pair, ``grouped_mm`` (the default in 5.17 and 5.24) sorts
the pairs by expert and runs torch's grouped GEMM. Ours is the grouped one, with less kept for the backward pass:

* pairs are sorted by expert once (``argsort``), their counts come from ``histc`` (no host sync), and two grouped
  GEMMs (``torch.nn.functional.grouped_mm``, else ``torch._grouped_mm``: CUTLASS kernels on Hopper) do the
  up/gate and the down projections, every expert in one call: no Python loop over experts;
* the routing weight multiplies the (pairs x intermediate) activation before the down projection, not its (pairs x
  hidden) output (the same sum, as the down projection is linear): the output need not be kept for the weights'
  gradient, and the product is 768 wide instead of 2048 at the 30B-A3B shape;
* SiLU(gate) * up * weight is one autograd function that keeps only the gate/up projection and the weights,
  recomputing the rest in its backward: per (token, expert) pair the backward keeps H + 3I
  values (the gathered input, gate/up, the down projection's input) where transformers' grouped path keeps
  2H + 4I (also SiLU(gate), and the down projection's output for the weights' gradient): 4,352 against 7,168 at
  the 30B-A3B shape (H 2048, I 768);
* no expert-parallel sentinel masks (transformers 5.17 always applies three masked fills).

`use_grouped_experts` switches a loaded model to it: the Qwen MoE descriptors' ``prepare_model`` does, which the
trainer calls after loading. ``plugins/vlmreg-qwen3-vl-moe/tests/test_grouped_experts.py`` checks logprobs and every
gradient against transformers' eager loop, in fp32, for qwen3_vl_moe and qwen3_5_moe.
The routers' auxiliary load-balancing loss is not added: transformers adds it only when
``output_router_logits`` is set (false in the published Qwen3-VL-MoE configs) and labels are given; vlmreg's RL
loss is computed from the logits alone.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "GROUPED",
    "experts_implementations",
    "grouped_experts_forward",
    "grouped_mm_available",
    "register_grouped_experts",
    "use_grouped_experts",
]

#: The name under which transformers' experts interface finds our forward.
GROUPED = "vlmreg_grouped"


def grouped_mm_available() -> bool:
    """Whether this torch has a grouped GEMM (torch >= 2.9)."""
    return hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")


def _grouped_mm() -> Any:
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if grouped is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped_mm (torch >= 2.9 has); use experts 'grouped_mm'")
    return grouped


class _ScaledSwiGLU(torch.autograd.Function):
    """``silu(gate) * up * weight`` per row of ``gate_up`` (gate columns first), keeping only its inputs. In the
    inputs' dtype, as transformers' own activation; the routing weights' gradient sums in fp32."""

    @staticmethod
    def forward(ctx: Any, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate_up, weight)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up * weight.to(gate_up.dtype).unsqueeze(-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, weight = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        sigmoid = torch.sigmoid(gate)
        silu = gate * sigmoid
        grad_weight = (grad * silu * up).sum(dim=-1, dtype=torch.float32)
        grad_act = grad * weight.to(grad.dtype).unsqueeze(-1)
        grad_gate = grad_act * up * sigmoid * (1 + gate * (1 - sigmoid))
        return torch.cat([grad_gate, grad_act * silu], dim=-1), grad_weight.to(weight.dtype)


def grouped_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' output for ``hidden_states`` (tokens, hidden) routed to ``top_k_index`` with ``top_k_weights``
    (tokens, k): ``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))`` over each token's k experts ``e``."""
    activation = getattr(getattr(self, "config", None), "hidden_act", None)
    plain = activation in ("silu", "swish") and getattr(self, "is_concatenated", True)
    plain = plain and not getattr(self, "is_transposed", False) and not getattr(self, "has_bias", False)
    if not plain or not getattr(self, "has_gate", True):
        raise NotImplementedError(
            f"{type(self).__name__}: experts '{GROUPED}' takes fused (gate rows, then up rows), untransposed, "
            "SiLU-gated experts without biases"
        )
    grouped = _grouped_mm()
    tokens, top_k = top_k_index.shape
    experts = self.num_experts
    pairs = top_k_index.reshape(-1)
    order = torch.argsort(pairs, stable=True)  # (token, slot) pairs, expert by expert
    # histc, not bincount: no device-to-host sync (CPU histc takes floats only)
    counts = torch.histc(pairs.float() if pairs.device.type == "cpu" else pairs.int(), experts, 0, experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    rows = order // top_k
    gate_up = grouped(hidden_states[rows].to(self.gate_up_proj.dtype), self.gate_up_proj.transpose(1, 2), offs=offsets)
    act = _ScaledSwiGLU.apply(gate_up, top_k_weights.reshape(-1)[order])
    out = grouped(act, self.down_proj.transpose(1, 2), offs=offsets)  # (pairs, hidden), sorted by expert
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return out[back].view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def register_grouped_experts() -> str:
    """Register ``vlmreg_grouped`` with transformers' experts interface (idempotent) and return its name."""
    # deferred: start-up cost (loads transformers)
    from transformers.integrations.moe import ExpertsInterface  # noqa: PLC0415

    ExpertsInterface.register(GROUPED, grouped_experts_forward)
    return GROUPED


def experts_implementations(model: torch.nn.Module) -> set[str]:
    """The experts implementations the model's configs name (empty for a model without routed experts)."""
    configs: list[Any] = [getattr(m, "config", None) for m in model.modules()]
    return {c._experts_implementation for c in configs if getattr(c, "_experts_implementation", None) is not None}


def has_routed_experts(model: torch.nn.Module) -> bool:
    """Whether the model holds fused routed experts that transformers dispatches by ``_experts_implementation``."""
    return any(hasattr(type(m), "_apply_gate") and hasattr(m, "gate_up_proj") for m in model.modules())


def use_grouped_experts(model: torch.nn.Module, implementation: str = GROUPED) -> str | None:
    """Switch the model's routed experts to ``implementation`` (default ours; ``grouped_mm``, ``batched_mm``,
    ``eager``: transformers' own). Returns what was set, or ``None`` for a model without routed experts."""
    if not has_routed_experts(model):
        return None
    if implementation == GROUPED:
        register_grouped_experts()
    model.set_experts_implementation(implementation)  # type: ignore[operator]
    return implementation
