"""Checkpoint names of fused MoE experts: transformers 5 fuses them in memory, some checkpoints store them unfused.

In memory (transformers 5), each MoE layer holds two 3-D parameters::

    mlp.experts.gate_up_proj   (experts, 2 * intermediate, hidden)   gate rows first, then up rows
    mlp.experts.down_proj      (experts, hidden, intermediate)

``save_pretrained`` of Qwen3.5-MoE writes them back unfused, one ``nn.Linear`` weight per expert::

    mlp.experts.{i}.gate_proj.weight   (intermediate, hidden)   = gate_up_proj[i, :intermediate]
    mlp.experts.{i}.up_proj.weight     (intermediate, hidden)   = gate_up_proj[i, intermediate:]
    mlp.experts.{i}.down_proj.weight   (hidden, intermediate)   = down_proj[i]

`unfuse_experts` and `fuse_experts` are the descriptor's ``checkpoint_weights`` / ``memory_weights`` for such
families. Unfusing yields views (no copy); fusing allocates the fused tensors. No torch import at module level.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["fuse_experts", "transpose_experts", "unfuse_experts"]

_FUSED = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_UNFUSED = re.compile(r"^(?P<base>.*\.mlp\.experts)\.(?P<index>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$")


def unfuse_experts(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """In-memory (name, tensor) pairs to checkpoint pairs: fused 3-D experts become per-expert 2-D views."""
    for name, tensor in weights:
        match = _FUSED.match(name)
        if match is None:
            yield name, tensor
            continue
        base, kind = match["base"], match["kind"]
        if tensor.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D fused expert tensor, got shape {tuple(tensor.shape)}")
        if kind == "gate_up_proj":
            half = tensor.shape[1] // 2
            for i in range(tensor.shape[0]):
                yield f"{base}.{i}.gate_proj.weight", tensor[i, :half]
                yield f"{base}.{i}.up_proj.weight", tensor[i, half:]
        else:
            for i in range(tensor.shape[0]):
                yield f"{base}.{i}.down_proj.weight", tensor[i]


def fuse_experts(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Checkpoint (name, tensor) pairs to in-memory pairs: per-expert weights are stacked into the fused tensors.

    Other names pass through at once; fused tensors come last, when every expert of a layer has been seen.
    A layer with a missing expert or projection raises ``ValueError`` naming it.
    """
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    groups: dict[str, dict[str, dict[int, Any]]] = {}
    for name, tensor in weights:
        match = _UNFUSED.match(name)
        if match is None:
            yield name, tensor
            continue
        groups.setdefault(match["base"], {}).setdefault(match["kind"], {})[int(match["index"])] = tensor
    for base, kinds in groups.items():
        count = max(max(parts) for parts in kinds.values()) + 1
        for kind in ("gate_proj", "up_proj", "down_proj"):
            missing = [i for i in range(count) if i not in kinds.get(kind, {})]
            if missing:
                raise ValueError(
                    f"{base}.{missing[0]}.{kind}.weight is missing; cannot fuse the {count} experts of {base}"
                )
        gate = torch.stack([kinds["gate_proj"][i] for i in range(count)])
        up = torch.stack([kinds["up_proj"][i] for i in range(count)])
        yield f"{base}.gate_up_proj", torch.cat([gate, up], dim=1)
        yield f"{base}.down_proj", torch.stack([kinds["down_proj"][i] for i in range(count)])


def transpose_experts(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Fused experts between the in-memory and the published layout of Qwen3-VL-MoE checkpoints (both directions).

    transformers 5 (5.17 and 5.23 alike) transposes dims 1 and 2 of ``mlp.experts.gate_up_proj`` and
    ``mlp.experts.down_proj`` when it loads these checkpoints: (E, 2I, H) / (E, H, I) in memory, (E, H, 2I) /
    (E, I, H) in the published files, which is what vLLM's loader expects. The transpose is a view (no copy).
    """
    for name, tensor in weights:
        if _FUSED.match(name):
            if tensor.dim() != 3:
                raise ValueError(f"{name}: expected a 3-D fused expert tensor, got shape {tuple(tensor.shape)}")
            yield name, tensor.transpose(1, 2)
        else:
            yield name, tensor
