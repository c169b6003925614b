"""What a module, a model or its optimizer weighs, for the recompute planner (`vlmreg.modeling.recompute`): the
parameters a token's matmuls use (`active_params`: of a MoE layer's routed experts only those a token reaches), the
bytes held by weights, gradients and optimizer state (`held_bytes`, of a sharded tensor this rank's shard), and the
bytes of parameters gathered whole (`unsharded_bytes`, as FSDP2 gathers them)."""

from __future__ import annotations

from typing import Any, cast

import torch

__all__ = ["EXPERT_COUNT_KEYS", "active_params", "held_bytes", "is_sharded", "local_part", "unsharded_bytes"]


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (a DTensor's local shard); any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return cast(torch.Tensor, to_local()) if callable(to_local) else tensor


#: The config keys that give a MoE layer's routed experts and how many of them a token uses (transformers' names).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def active_params(module: torch.nn.Module, config: Any) -> int:
    """The parameters a token's matmuls use in ``module`` (a sharded parameter at its global size): routed experts,
    transformers' fused 3-D parameters under an ``experts`` module, count ``num_experts_per_tok`` of the ``config``'s
    experts; every other parameter counts whole. What the planner weighs a module's recomputation by."""
    experts = next((getattr(config, k) for k in EXPERT_COUNT_KEYS if getattr(config, k, None)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    total = 0
    for name, p in module.named_parameters():
        count = p.numel()
        if experts and top_k and p.dim() == 3 and "experts" in name.split("."):
            count = count * top_k // experts
        total += count
    return total


def unsharded_bytes(params: Any) -> int:
    """Bytes of ``params`` whole (a sharded parameter at its global size, as FSDP2 gathers it)."""
    return sum(p.numel() * p.element_size() for p in params)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are sharded (FSDP2's DTensors)."""
    return any(hasattr(p, "device_mesh") for p in model.parameters())


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the model's weights and buffers, their gradients and the optimizer's state (each storage once; of a
    sharded tensor, this rank's local shard)."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = local_part(t).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                add(value)
    return sum(seen.values())
