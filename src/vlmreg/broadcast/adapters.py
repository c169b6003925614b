"""LoRA that stays LoRA on the wire: which adapted modules a server serves as adapters, and the names their tensors
travel under.

An adapter sync sends, per adapted module the server serves as LoRA, peft's two factors under the names peft's own
``save_pretrained`` writes (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``, the module's in-memory
name), so any engine that loads peft adapters (vLLM, peft itself) reads them as they are. What the server cannot serve
as LoRA (a module it does not adapt, with another rank or scaling, or fused MoE experts adapted through
``target_parameters``) is merged into its base weight and sent as a base weight, every sync; the choice is per module
(`split_modules`) and the trainer logs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from vlmreg.broadcast.errors import BroadcastError

__all__ = [
    "ADAPTER_PREFIX",
    "AdapterModule",
    "FactorCast",
    "ModuleSplit",
    "adapter_modules",
    "adapter_tensor_name",
    "adapter_module_of",
    "is_adapter_tensor",
    "split_modules",
]

#: The prefix peft's ``save_pretrained`` puts before each module name of an adapter.
ADAPTER_PREFIX = "base_model.model."
_FACTORS = (".lora_A.weight", ".lora_B.weight")


def adapter_tensor_name(module: str, factor: str) -> str:
    """The wire (and peft file) name of factor ``"A"`` or ``"B"`` of ``module`` (its in-memory name)."""
    return f"{ADAPTER_PREFIX}{module}.lora_{factor}.weight"


def is_adapter_tensor(name: str) -> bool:
    return name.startswith(ADAPTER_PREFIX) and name.endswith(_FACTORS)


def adapter_module_of(name: str) -> str:
    """The in-memory module name an adapter tensor belongs to."""
    for suffix in _FACTORS:
        if name.endswith(suffix):
            return name[len(ADAPTER_PREFIX) : -len(suffix)]
    raise ValueError(f"{name!r} is not an adapter tensor name")


@attrs.frozen(eq=False)
class AdapterModule:
    """One plain LoRA layer (``W + scaling * B @ A`` on a module's weight) that can travel as an adapter."""

    name: str
    layer: Any
    adapter: str
    r: int
    scaling: float

    @property
    def factors(self) -> tuple[tuple[str, nn.Parameter], tuple[str, nn.Parameter]]:
        """(wire name, parameter) of ``lora_A`` and ``lora_B``."""
        return (
            (adapter_tensor_name(self.name, "A"), self.layer.lora_A[self.adapter].weight),
            (adapter_tensor_name(self.name, "B"), self.layer.lora_B[self.adapter].weight),
        )

    def describe(self) -> dict[str, Any]:
        return {"r": self.r, "scaling": self.scaling}


def adapter_modules(lora_layers: Mapping[str, Any]) -> dict[str, AdapterModule]:
    """Module name -> `AdapterModule` for each peft LoRA layer that can travel as an adapter: a module's own LoRA
    (not a ``target_parameters`` wrapper of a fused parameter, which is always merged) with exactly one active
    adapter. ``lora_layers``: module name -> peft layer, the names peft-free (in-memory names)."""
    modules: dict[str, AdapterModule] = {}
    for name, layer in lora_layers.items():
        if getattr(layer, "parameter_name", None):  # peft's ParamWrapper: LoRA on a fused 3-D parameter
            continue
        if layer.disable_adapters:
            continue
        active = [a for a in layer.active_adapters if a in layer.lora_A and a not in layer.merged_adapters]
        if not active:
            continue
        if len(active) > 1:
            raise BroadcastError(
                f"{name}: {len(active)} active LoRA adapters ({', '.join(active)}); adapter syncs send one"
            )
        adapter = active[0]
        modules[name] = AdapterModule(name, layer, adapter, int(layer.r[adapter]), float(layer.scaling[adapter]))
    return modules


class FactorCast:
    """Adapter factors in another dtype (vLLM's), written each sync into one buffer kept from sync to sync: a sync
    then sends the same memory every time, so a CUDA IPC receiver maps it once and later syncs reuse the mapping (a
    fresh cast of each factor would be new memory, shared and mapped again every sync)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.views: list[torch.Tensor] = []

    def __call__(self, factors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        devices = {f.device for f in factors}
        if len(devices) != 1:
            return [f.detach().to(dtype) for f in factors]
        key = (dtype, *devices, tuple(tuple(f.shape) for f in factors))
        if key != self.key:
            sizes = [f.numel() for f in factors]
            buffer = torch.empty(sum(sizes), dtype=dtype, device=factors[0].device)
            self.views = [v.view(f.shape) for v, f in zip(torch.split(buffer, sizes), factors, strict=True)]
            self.key = key
        with torch.no_grad():
            torch._foreach_copy_(self.views, [f.detach() for f in factors])
        return self.views


def _reasons(reasons: Mapping[str, str]) -> dict[str, str]:
    return dict(reasons)


@attrs.frozen
class ModuleSplit:
    """Which adapted modules travel as adapters and which are merged into base weights, with why."""

    adapters: frozenset[str]
    merged: Mapping[str, str] = attrs.field(converter=_reasons)  # module -> reason

    def summary(self, server: str) -> str:
        """One line for the run's log: counts, and the first merged modules with their reasons."""
        line = (
            f"LoRA syncs to {server}: {len(self.adapters)} module(s) as adapters, {len(self.merged)} merged into "
            "base weights"
        )
        if self.merged:
            reasons: dict[str, list[str]] = {}
            for module, reason in self.merged.items():
                reasons.setdefault(reason, []).append(module)
            parts = [f"{len(mods)} {reason} (e.g. {mods[0]})" for reason, mods in reasons.items()]
            line += ": " + "; ".join(parts)
        return line


def split_modules(
    adapted: Iterable[str],
    keepable: Mapping[str, AdapterModule],
    served: Mapping[str, Mapping[str, Any]] | Iterable[str],
) -> ModuleSplit:
    """Per adapted module of the trainer: an adapter when the server serves it as LoRA (``served``: module name ->
    ``{"r", "scaling"}`` as the server reports them, or bare names when the server takes the trainer's own rank and
    scaling), else merged, with the reason."""
    served_map = dict(served) if isinstance(served, Mapping) else {name: {} for name in served}
    kept: set[str] = set()
    merged: dict[str, str] = {}
    for module in adapted:
        own = keepable.get(module)
        if own is None:
            merged[module] = "fused-parameter LoRA (target_parameters), merged always"
            continue
        theirs = served_map.get(module)
        if theirs is None:
            merged[module] = "not served as LoRA by the server"
            continue
        r, scaling = theirs.get("r", own.r), theirs.get("scaling", own.scaling)
        if int(r) != own.r or abs(float(scaling) - own.scaling) > 1e-6 * max(1.0, abs(own.scaling)):
            raise BroadcastError(
                f"{module}: the server serves LoRA of rank {r} scaling {scaling}, the trainer's is rank {own.r} "
                f"scaling {own.scaling}; start the server with the trainer's [model.lora] (r, alpha)"
            )
        kept.add(module)
    return ModuleSplit(frozenset(kept), merged)
