"""`WeightPlan`: which weights a sync sends and under which names; `apply_weights` puts them into a model.

Sent every sync: every parameter under the language model (decoder layers under the weight prefix, embeddings,
final norm) and the lm_head, unless the lm_head *is* the embedding matrix (tied weights are absent from a
checkpoint). The vision tower and the connectors (with the descriptor's bare ``connector_parameters``) are sent only where they change (trainable, or adapted by
LoRA); ``include_frozen_vision=True`` adds the frozen rest, for the first sync.

Names on the wire are checkpoint names (what ``save_pretrained`` writes), produced from the in-memory names by
the family's ``checkpoint_weights``, so any engine that loads the family's checkpoints can take them.

A peft-wrapped model sends merged weights, ``W + scaling * B @ A`` per adapted module or parameter (peft's own
delta, fused MoE experts adapted through ``target_parameters`` included), under the base model's names: the
base weights are never modified, so there is nothing to unmerge.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from vlmreg.broadcast.errors import BroadcastError, LayoutMismatchError
from vlmreg.resolution import ResolvedFamily
from vlmreg.sdk.descriptor import FamilyDescriptor

__all__ = ["PlannedWeight", "WeightPlan", "apply_weights"]


@attrs.frozen(eq=False)
class PlannedWeight:
    """One in-memory parameter to send, with the LoRA adapters whose deltas are merged into it."""

    name: str
    parameter: nn.Parameter
    adapters: tuple[tuple[Any, str], ...] = ()

    def value(self) -> torch.Tensor:
        """The weight as an inference engine should see it: the parameter itself (no copy, not even a detach: this
        runs for every tensor of every sync), or a fresh tensor when adapters are merged."""
        if hasattr(self.parameter, "full_tensor"):  # an FSDP shard: gathered, collectively, on every trainer rank
            if self.adapters:
                raise BroadcastError(f"{self.name}: merging LoRA adapters into FSDP-sharded weights is not supported")
            return self.parameter.full_tensor()
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

    @classmethod
    def from_resolved(cls, resolved: ResolvedFamily, *, include_frozen_vision: bool) -> WeightPlan:
        """The plan for a resolved model (peft-wrapped or not): language model, lm_head, changing vision parts."""
        d = resolved.descriptor
        weights = _named_weights(resolved.model, d.lm_head_attr)
        language = [w for w in weights if _under(w.name, (d.language_model_attr,))]
        head = [w for w in weights if _under(w.name, (d.lm_head_attr,))]
        taken = {id(w) for w in language + head}
        vision = [
            w
            for w in weights
            if id(w) not in taken
            and (_under(w.name, (d.vision_encoder_attr, *d.connector_attrs)) or w.name in d.connector_parameters)
            and (include_frozen_vision or w.parameter.requires_grad or bool(w.adapters))
        ]
        return cls(d, tuple(language + head + vision), include_frozen_vision)

    @property
    def changes_images(self) -> bool:
        """Whether this plan sends image-side weights (vision encoder, connectors): then an engine's cached image
        embeddings go stale with each sync."""
        d = self.descriptor
        return any(_under(w.name, (d.vision_encoder_attr, *d.connector_attrs)) or w.name in d.connector_parameters for w in self.weights)

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(in-memory name, tensor) pairs, adapters merged; the parameters themselves when there are none."""
        for weight in self.weights:
            yield weight.name, weight.value()

    def shapes(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, meta tensor) pairs: the names, shapes and dtypes on the wire, computed without touching
        (or, for FSDP shards, gathering) any weight."""
        meta = ((w.name, torch.empty(tuple(w.parameter.shape), dtype=w.parameter.dtype, device="meta")) for w in self.weights)
        yield from self.descriptor.checkpoint_weights(meta)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) pairs: what goes on the wire. Do not modify them: they may be the parameters."""
        yield from self.descriptor.checkpoint_weights(self.memory_tensors())

    def __len__(self) -> int:
        return len(self.weights)


def apply_weights(resolved: ResolvedFamily, received: Mapping[str, torch.Tensor]) -> int:
    """Copy received tensors (checkpoint names) into the model's parameters in place; returns how many were written.

    Names are mapped back with the family's ``memory_weights``. Every tensor is checked (known name, same shape
    and dtype) before the first copy, so a mismatch leaves the model untouched.
    """
    targets = {w.name: w for w in WeightPlan.from_resolved(resolved, include_frozen_vision=True).weights}
    try:
        memory = list(resolved.descriptor.memory_weights(received.items()))
    except ValueError as exc:
        raise LayoutMismatchError(f"received weights do not map to {resolved.name} parameters: {exc}") from None
    pending: list[tuple[nn.Parameter, torch.Tensor]] = []
    for name, tensor in memory:
        weight = targets.get(name)
        if weight is None:
            raise LayoutMismatchError(f"received {name!r}, but this {resolved.name} model has no such parameter")
        if weight.adapters:
            raise BroadcastError(f"{name}: the receiving model has LoRA adapters on this weight; apply merged weights to a model without them")
        expected = weight.parameter
        if tuple(tensor.shape) != tuple(expected.shape) or tensor.dtype != expected.dtype:
            raise LayoutMismatchError(
                f"{name}: received {tuple(tensor.shape)} {_dtype_name(tensor.dtype)}, "
                f"the model has {tuple(expected.shape)} {_dtype_name(expected.dtype)}"
            )
        pending.append((expected, tensor))
    with torch.no_grad():
        for parameter, tensor in pending:
            parameter.copy_(tensor)
    return len(pending)


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
                f"{name}: adapter {adapter!r} is a LoRA variant ({type(variant).__name__}); the broadcaster merges plain "
                "LoRA only (W + scaling * B @ A)"
            )
        if getattr(layer, "lora_bias", {}).get(adapter):
            raise BroadcastError(f"{name}: adapter {adapter!r} has lora_bias=True, which the broadcaster does not merge")
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


def _named_weights(model: nn.Module, lm_head_attr: str) -> list[PlannedWeight]:
    """Every base parameter once, in model order, under its peft-free name, with its adapters.

    A parameter registered under several names (tied embeddings) keeps a name outside the lm_head, because
    ``save_pretrained`` drops the tied lm_head.
    """
    layers = _lora_layers(model)
    adapter_ids: set[int] = set()
    adapters: dict[int, list[tuple[Any, str]]] = {}
    for name, layer in layers.items():
        base = layer.get_base_layer()
        adapter_ids |= {id(p) for p in layer.parameters()} - {id(p) for p in base.parameters()}
        parameter_name = getattr(layer, "parameter_name", None) or "weight"
        target = getattr(base, parameter_name)
        for adapter in _active_adapters(layer, name):
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
