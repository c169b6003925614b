"""`WeightPlan`: which weights a sync sends and under which names; `apply_weights` puts them into a model.

Sent every sync: every parameter under the language model (decoder layers under the weight prefix, embeddings,
final norm) and the lm_head, unless the lm_head *is* the embedding matrix (tied weights are absent from a
checkpoint). The vision tower and the connectors (with the descriptor's bare ``connector_parameters``) are sent only
where they change (trainable, or adapted by LoRA); ``include_frozen_vision=True`` adds the frozen rest, for the first
sync.

Names on the wire are checkpoint names (what ``save_pretrained`` writes), produced from the in-memory names by
the family's ``checkpoint_weights``, so any engine that loads the family's checkpoints can take them.

A peft-wrapped model sends merged weights, ``W + scaling * B @ A`` per adapted module or parameter (peft's own
delta, fused MoE experts adapted through ``target_parameters`` included), under the base model's names: the
base weights are never modified, so there is nothing to unmerge.

Adapter syncs (``lora_modules``: the adapted modules the server serves as LoRA, `vlmreg.broadcast.adapters`): those
modules' base weights travel unmerged and only in the full sync (they are frozen), their ``lora_A`` / ``lora_B`` every
sync under peft's names; every other adapted weight is merged, every sync; a frozen weight without adapters travels
only in the full sync.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import attrs
import torch
from torch import nn

from vlmreg.broadcast.adapters import (
    AdapterModule,
    FactorCast,
    adapter_module_of,
    adapter_modules,
    adapter_tensor_name,
    is_adapter_tensor,
)
from vlmreg.broadcast.errors import BroadcastError, LayoutMismatchError
from vlmreg.broadcast.shard_gather import gather_to_first
from vlmreg.resolution import ResolvedFamily
from vlmreg.sdk.descriptor import FamilyDescriptor

__all__ = ["PlannedWeight", "WeightPlan", "apply_weights", "lora_modules", "receiving_plan", "served_lora"]


@attrs.frozen(eq=False)
class PlannedWeight:
    """One in-memory parameter to send, with the LoRA adapters whose deltas are merged into it."""

    name: str
    parameter: nn.Parameter
    adapters: tuple[tuple[Any, str], ...] = ()

    def value(self) -> torch.Tensor:
        """The weight as an inference engine should see it: the parameter itself (no copy, not even a detach: this
        runs for every tensor of every sync), or a fresh tensor when adapters are merged. An FSDP shard's is whole on
        the trainer's rank 0, which sends it, and a meta tensor of its shape on the other ranks (`gather_to_first`)."""
        if hasattr(self.parameter, "full_tensor"):  # an FSDP shard: gathered to the sending rank, collectively
            if self.adapters:
                raise BroadcastError(f"{self.name}: merging LoRA adapters into FSDP-sharded weights is not supported")
            return gather_to_first(self.parameter)
        if not self.adapters:
            return self.parameter
        with torch.no_grad():
            merged = self.parameter.detach().clone()
            for layer, adapter in self.adapters:
                merged += layer.get_delta_weight(adapter)
        return merged


@attrs.frozen(eq=False)
class WeightPlan:
    """The weights of one kind of sync, in a fixed order; `tensors` yields them under checkpoint names."""

    descriptor: FamilyDescriptor
    weights: tuple[PlannedWeight, ...]
    include_frozen_vision: bool
    adapters: tuple[AdapterModule, ...] = ()
    lora_dtype: torch.dtype | None = None
    _cast: FactorCast = attrs.field(factory=FactorCast, init=False, repr=False)  # the factors in lora_dtype

    @classmethod
    def from_resolved(
        cls,
        resolved: ResolvedFamily,
        *,
        include_frozen_vision: bool,
        lora_modules: frozenset[str] | set[str] | None = None,
        lora_base: bool = True,
        lora_dtype: torch.dtype | None = None,
    ) -> WeightPlan:
        """The plan for a resolved model (peft-wrapped or not): language model, lm_head, changing vision parts.

        ``lora_modules``: adapter syncs, these modules' LoRA sent as adapters (see the module's docstring); ``None``:
        every adapter merged. ``lora_base=False``: their frozen base weights are never sent (an engine that loaded them
        from the checkpoint and cannot reload weights under its LoRA layers: vLLM). ``lora_dtype``: the dtype the
        factors travel in (``None``: their own; vLLM computes LoRA in the model's dtype, so they go in that, half of
        peft's fp32)."""
        d = resolved.descriptor
        layers = _lora_layers(resolved.model)
        kept: dict[str, AdapterModule] = {}
        if lora_modules is not None:
            keepable = adapter_modules(layers)
            unknown = sorted(set(lora_modules) - set(keepable))
            if unknown:
                raise BroadcastError(
                    f"{unknown[0]}: not a plain LoRA module of this model, so it cannot travel as an adapter"
                )
            kept = {name: keepable[name] for name in keepable if name in lora_modules}
        weights = _named_weights(resolved.model, d.lm_head_attr, layers, set(kept))
        language = [w for w in weights if _under(w.name, (d.language_model_attr,))]
        head = [w for w in weights if _under(w.name, (d.lm_head_attr,))]
        taken = {id(w) for w in language + head}
        vision = [
            w
            for w in weights
            if id(w) not in taken
            and (_under(w.name, (d.vision_encoder_attr, *d.connector_attrs)) or w.name in d.connector_parameters)
            and (include_frozen_vision or _changes(w))
        ]
        # adapter syncs: frozen base weights only in the full sync
        if lora_modules is not None and not include_frozen_vision:
            language, head = [w for w in language if _changes(w)], [w for w in head if _changes(w)]
        if not lora_base:
            roots = tuple(name + "." for name in kept)
            language, head, vision = (
                [w for w in part if not w.name.startswith(roots) or _changes(w)] for part in (language, head, vision)
            )
        return cls(d, tuple(language + head + vision), include_frozen_vision, tuple(kept.values()), lora_dtype)

    @property
    def sharded(self) -> bool:
        """Whether any weight is an FSDP shard (each one's value is a gather across the trainer's ranks)."""
        return any(hasattr(w.parameter, "full_tensor") for w in self.weights)

    @property
    def changes_images(self) -> bool:
        """Whether this plan sends image-side weights (vision encoder, connectors), as weights or as adapters: then an
        engine's cached image embeddings go stale with each sync."""
        d = self.descriptor
        roots = (d.vision_encoder_attr, *d.connector_attrs)
        return any(_under(w.name, roots) or w.name in d.connector_parameters for w in self.weights) or any(
            _under(a.name, roots) for a in self.adapters
        )

    def adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(peft name, parameter) of each adapter factor this plan sends."""
        for module in self.adapters:
            yield from module.factors

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(in-memory name, tensor) pairs, adapters merged; the parameters themselves when there are none."""
        for weight in self.weights:
            yield weight.name, weight.value()

    def shapes(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, meta tensor) pairs: the names, shapes and dtypes on the wire, computed without touching
        (or, for FSDP shards, gathering) any weight; adapter factors last, under peft's names."""
        meta = (
            (w.name, torch.empty(tuple(w.parameter.shape), dtype=w.parameter.dtype, device="meta"))
            for w in self.weights
        )
        yield from self.descriptor.checkpoint_weights(meta)
        for name, factor in self.adapter_tensors():
            yield name, torch.empty(tuple(factor.shape), dtype=self.lora_dtype or factor.dtype, device="meta")

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) pairs: what goes on the wire, adapter factors last under peft's names. Do not
        modify them: they may be the parameters."""
        yield from self.descriptor.checkpoint_weights(self.memory_tensors())
        factors = list(self.adapter_tensors())
        for name, factor in factors:
            if hasattr(factor, "full_tensor"):
                raise BroadcastError(
                    f"{name}: adapter syncs from FSDP-sharded LoRA are not supported; set broadcast.lora_sync = "
                    '"merged"'
                )
        if self.lora_dtype is None or all(factor.dtype == self.lora_dtype for _, factor in factors):
            yield from factors
        else:  # cast into the same buffer every sync (`FactorCast`)
            yield from zip([n for n, _ in factors], self._cast([f for _, f in factors], self.lora_dtype), strict=True)

    def __len__(self) -> int:
        return len(self.weights) + 2 * len(self.adapters)


def apply_weights(resolved: ResolvedFamily, received: Mapping[str, torch.Tensor]) -> int:
    """Copy received tensors (checkpoint names) into the model's parameters in place; returns how many were written.

    Names are mapped back with the family's ``memory_weights``. Every tensor is checked (known name, same shape
    and dtype) before the first copy, so a mismatch leaves the model untouched.

    A model with LoRA layers (a server that serves adapters) takes adapter factors under peft's names into its
    adapters, and base weights into its base layers. A merged weight for a module it holds an adapter on (the sender
    merged it: `vlmreg.broadcast.adapters.split_modules`) zeroes that adapter's ``lora_B``, so the merged weight is
    the whole of it; fused-parameter LoRA (``target_parameters``) is always sent merged.
    """
    keepable = adapter_modules(_lora_layers(resolved.model))
    plan = receiving_plan(resolved)
    factors = dict(plan.adapter_tensors())
    base = {name: t for name, t in received.items() if not is_adapter_tensor(name)}
    pending: list[tuple[nn.Parameter, torch.Tensor]] = []
    for name, tensor in received.items():
        if not is_adapter_tensor(name):
            continue
        if name not in factors:
            raise LayoutMismatchError(
                f"received adapter {name!r}, but this {resolved.name} model has no LoRA on {adapter_module_of(name)!r}"
            )
        pending.append((_checked(name, tensor, factors[name]), tensor))
    targets = {w.name: w for w in plan.weights}
    try:
        memory = list(resolved.descriptor.memory_weights(base.items()))
    except ValueError as exc:
        raise LayoutMismatchError(f"received weights do not map to {resolved.name} parameters: {exc}") from None
    silenced: list[Any] = []
    for name, tensor in memory:
        weight = targets.get(name)
        if weight is None:
            raise LayoutMismatchError(f"received {name!r}, but this {resolved.name} model has no such parameter")
        module = name.removesuffix(".weight")
        if weight.adapters:  # LoRA on a fused parameter: sent merged
            silenced += list(weight.adapters)
        elif name.endswith(".weight") and module in keepable and not _adapter_names_of(module) & set(received):
            # merged by the sender: the adapter must not add
            silenced.append((keepable[module].layer, keepable[module].adapter))
        pending.append((_checked(name, tensor, weight.parameter), tensor))
    with torch.no_grad():
        for parameter, tensor in pending:
            parameter.copy_(tensor)
        for layer, adapter in silenced:
            layer.lora_B[adapter].weight.zero_()
    return len(pending)


def receiving_plan(resolved: ResolvedFamily) -> WeightPlan:
    """Everything a server holding ``resolved`` can take, as a full plan: its base weights, and the adapters of every
    plain LoRA layer it has (a server that serves adapters)."""
    keepable = adapter_modules(_lora_layers(resolved.model))
    return WeightPlan.from_resolved(
        resolved, include_frozen_vision=True, lora_modules=frozenset(keepable) if keepable else None
    )


def lora_modules(resolved: ResolvedFamily) -> tuple[list[str], dict[str, AdapterModule]]:
    """The model's adapted modules (every peft LoRA layer, by in-memory name), and those of them that can travel as
    adapters (`vlmreg.broadcast.adapters.adapter_modules`)."""
    layers = _lora_layers(resolved.model)
    return list(layers), adapter_modules(layers)


def served_lora(resolved: ResolvedFamily) -> dict[str, dict[str, Any]]:
    """Module name -> ``{"r", "scaling"}`` of each adapter this model can take as an adapter (what a server reports)."""
    return {name: module.describe() for name, module in adapter_modules(_lora_layers(resolved.model)).items()}


def _adapter_names_of(module: str) -> set[str]:
    return {adapter_tensor_name(module, "A"), adapter_tensor_name(module, "B")}


def _checked(name: str, tensor: torch.Tensor, expected: torch.Tensor) -> nn.Parameter:
    """``expected`` once ``tensor`` has its shape and dtype, else the mismatch."""
    if tuple(tensor.shape) != tuple(expected.shape) or tensor.dtype != expected.dtype:
        raise LayoutMismatchError(
            f"{name}: received {tuple(tensor.shape)} {_dtype_name(tensor.dtype)}, "
            f"the model has {tuple(expected.shape)} {_dtype_name(expected.dtype)}"
        )
    return expected  # type: ignore[return-value]


def _changes(weight: PlannedWeight) -> bool:
    """Whether a weight can differ from one sync to the next: trained, or with adapters merged into it."""
    return weight.parameter.requires_grad or bool(weight.adapters)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _under(name: str, roots: Sequence[str]) -> bool:
    return any(name.startswith(root + ".") for root in roots)


def _uses_peft(model: nn.Module) -> bool:
    return any(type(m).__module__.startswith("peft.") for m in model.modules())


def _lora_layers(model: nn.Module) -> dict[str, Any]:
    """Module name -> peft LoRA layer; any other peft wrapper is refused with its name."""
    if not _uses_peft(model):
        return {}
    # deferred: start-up cost (loads peft)
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415
    from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: PLC0415
    from peft.utils.other import AuxiliaryTrainingWrapper  # noqa: PLC0415

    layers: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            layers[name] = module
        elif isinstance(module, BaseTunerLayer | AuxiliaryTrainingWrapper):
            raise BroadcastError(
                f"{name}: peft {type(module).__name__} is not supported by the broadcaster (plain LoRA layers only)"
            )
    return layers


def _active_adapters(layer: Any, name: str) -> list[str]:
    """The adapters whose deltas belong in the merged weight, as ``merge_and_unload`` would pick them."""
    if layer.disable_adapters:
        return []
    adapters = [a for a in layer.active_adapters if a in layer.lora_A and a not in layer.merged_adapters]
    for adapter in adapters:
        variant = getattr(layer, "lora_variant", {}).get(adapter)
        if variant is not None:
            raise BroadcastError(
                f"{name}: adapter {adapter!r} is a LoRA variant ({type(variant).__name__}); the broadcaster merges "
                "plain LoRA only (W + scaling * B @ A)"
            )
        if getattr(layer, "lora_bias", {}).get(adapter):
            raise BroadcastError(
                f"{name}: adapter {adapter!r} has lora_bias=True, which the broadcaster does not merge"
            )
    return adapters


def _strip_peft(name: str, lora_names: set[str]) -> str:
    """Drop the ``base_layer`` segments peft inserts below each LoRA layer (nested wrappers insert several)."""
    kept: list[str] = []
    path = ""
    for part in name.split("."):
        is_inserted = part == "base_layer" and path in lora_names
        path = f"{path}.{part}" if path else part
        if not is_inserted:
            kept.append(part)
    return ".".join(kept)


def _named_weights(
    model: nn.Module, lm_head_attr: str, layers: dict[str, Any] | None = None, kept: AbstractSet[str] = frozenset()
) -> list[PlannedWeight]:
    """Every base parameter once, in model order, under its peft-free name, with the adapters merged into it (none
    for the modules in ``kept``, whose adapters travel as adapters).

    A parameter registered under several names (tied embeddings) keeps a name outside the lm_head, because
    ``save_pretrained`` drops the tied lm_head.
    """
    layers = _lora_layers(model) if layers is None else layers
    adapter_ids: set[int] = set()
    adapters: dict[int, list[tuple[Any, str]]] = {}
    for name, layer in layers.items():
        base = layer.get_base_layer()
        adapter_ids |= {id(p) for p in layer.parameters()} - {id(p) for p in base.parameters()}
        parameter_name = getattr(layer, "parameter_name", None) or "weight"
        target = getattr(base, parameter_name)
        active = _active_adapters(layer, name)
        if name in kept:
            continue
        for adapter in active:
            adapters.setdefault(id(target), []).append((layer, adapter))
    names: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    lora_names = set(layers)
    for raw, parameter in model.named_parameters(remove_duplicate=False):
        key = id(parameter)
        if key in adapter_ids:
            continue
        name = _strip_peft(raw, lora_names)
        if key not in names or (_under(names[key], (lm_head_attr,)) and not _under(name, (lm_head_attr,))):
            names[key] = name
            params[key] = parameter
    return [PlannedWeight(names[key], params[key], tuple(adapters.get(key, ()))) for key in names]
