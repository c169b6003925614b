"""`resolve`: check a family descriptor against one loaded model and hand back the real modules.

Everything downstream (loading, LoRA, the trainer, FSDP, the weight broadcaster) takes the
`ResolvedFamily` and never walks a path of its own, so a path that is wrong fails here, at load
time, with the candidates that exist instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
from torch import nn

from vlmreg.resolution.lora import LoraTargetSet, match_lora, match_lora_regex
from vlmreg.resolution.paths import resolve_module, resolve_parameter
from vlmreg.sdk.descriptor import FamilyDescriptor, LoraPreset
from vlmreg.sdk.errors import DescriptorError, ResolutionError, did_you_mean
from vlmreg.sdk.registry import get_registry

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["OVERRIDABLE", "ResolvedFamily", "resolve"]

#: Descriptor fields a user may override per run (``[model.vlm]`` in a config, ``overrides=`` here).
OVERRIDABLE = (
    "vision_encoder_attr",
    "language_model_attr",
    "layers_attr",
    "lm_head_attr",
    "connector_attrs",
    "vision_blocks_attr",
)


@attrs.frozen(eq=False)
class ResolvedFamily:
    """A family descriptor checked against one model: the modules themselves, and the derived names."""

    descriptor: FamilyDescriptor
    model: PreTrainedModel  # a transformers model (mypy reads it as Any: transformers is not followed)
    vision_encoder: nn.Module
    language_model: nn.Module
    layers: nn.ModuleList
    lm_head: nn.Module
    connectors: Mapping[str, nn.Module]
    vision_blocks: nn.ModuleList | None
    lora_presets: Mapping[str, LoraTargetSet]
    overrides: Mapping[str, Any]
    connector_parameters: Mapping[str, nn.Parameter] = attrs.field(factory=dict)

    @property
    def name(self) -> str:
        return self.descriptor.name

    @property
    def weight_prefix(self) -> str:
        """In-memory name prefix of the decoder layers (``{language_model_attr}.{layers_attr}.``), checked against real
        keys."""
        return self.descriptor.weight_prefix

    def paths(self) -> dict[str, Any]:
        d = self.descriptor
        return {
            "vision_encoder_attr": d.vision_encoder_attr,
            "language_model_attr": d.language_model_attr,
            "layers_attr": d.layers_attr,
            "lm_head_attr": d.lm_head_attr,
            "connector_attrs": list(d.connector_attrs),
            "connector_parameters": list(d.connector_parameters),
            "vision_blocks_attr": d.vision_blocks_attr,
        }

    def scope_roots(self) -> dict[str, tuple[str, ...]]:
        """Module paths covered by each LoRA scope."""
        d = self.descriptor
        return {
            "language_model": (d.language_model_attr,),
            "vision_encoder": (d.vision_encoder_attr,),
            "connectors": tuple(d.connector_attrs),
        }

    def lora_targets(
        self,
        targets: str | Sequence[str] | None = None,
        *,
        parameters: Sequence[str] = (),
        scopes: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
    ) -> LoraTargetSet:
        """Targets for a preset name (``None``: the family's default), ``"re:<regex>"`` on full module names, or an
        explicit list of module suffixes.

        A regex or a list is matched inside ``scopes`` (default: the language model) with the same strictness
        as a preset: each entry must match at least one module.
        """
        if isinstance(targets, str) and targets.startswith("re:"):
            if parameters or exclude:
                raise ResolutionError(
                    "LoRA targets: a re: pattern takes no parameters or exclude; fold them into the regex"
                )
            return match_lora_regex(
                self.model,
                targets[3:],
                self.scope_roots(),
                tuple(scopes or ("language_model",)),
                never=(self.descriptor.lm_head_attr,),
            )
        if targets is None or isinstance(targets, str):
            name = targets or self.descriptor.default_lora_preset
            presets = self.descriptor.lora_presets
            if name not in presets:
                raise ResolutionError(
                    f"Unknown LoRA preset {name!r} for family {self.name!r}.{did_you_mean(name, presets)} "
                    f"Presets: {', '.join(sorted(presets))}; or give a list of module names"
                )
            if not exclude and not parameters and scopes is None:
                return self.lora_presets[name]
            preset = presets[name]
            preset = attrs.evolve(
                preset, parameters=tuple(preset.parameters) + tuple(parameters), scopes=tuple(scopes or preset.scopes)
            )
        else:
            name = "explicit list"
            try:
                preset = LoraPreset(
                    modules=tuple(targets), parameters=tuple(parameters), scopes=tuple(scopes or ("language_model",))
                )
            except DescriptorError as exc:
                raise ResolutionError(f"LoRA targets: {exc}") from None
        return match_lora(
            self.model, name, preset, self.scope_roots(), never=(self.descriptor.lm_head_attr,), exclude=exclude
        )

    def summary(self) -> dict[str, Any]:
        """A JSON-ready view: paths, weight prefix and what each LoRA preset reaches."""
        return {
            "family": self.name,
            "model_class": type(self.model).__name__,
            **self.paths(),
            "weight_prefix": self.weight_prefix,
            "num_layers": len(self.layers),
            "num_vision_blocks": len(self.vision_blocks) if self.vision_blocks is not None else None,
            "overrides": dict(self.overrides),
            "lora_presets": {
                name: {
                    "modules": len(t.modules),
                    "parameters": len(t.parameters),
                    "matches": dict(t.matches),
                    "reaches_vision": t.reaches_vision,
                }
                for name, t in self.lora_presets.items()
            },
        }


def _apply_overrides(descriptor: FamilyDescriptor, overrides: Mapping[str, Any] | None) -> FamilyDescriptor:
    if not overrides:
        return descriptor
    for key in overrides:
        if key not in OVERRIDABLE:
            raise ResolutionError(
                f"Unknown override {key!r}.{did_you_mean(key, OVERRIDABLE)} Overridable: {', '.join(OVERRIDABLE)}"
            )
    changes: dict[str, Any] = {
        k: tuple(v) if k == "connector_attrs" and isinstance(v, list) else v for k, v in overrides.items()
    }
    try:
        return attrs.evolve(descriptor, **changes)
    except DescriptorError as exc:
        raise ResolutionError(f"override: {exc}") from None


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (peft keeps the same module objects)."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and hasattr(model, "peft_config"):
        return get_base()
    return model


def _check_layers(model: nn.Module, descriptor: FamilyDescriptor) -> nn.ModuleList:
    layers_path = descriptor.layers_path
    layers = resolve_module(model, layers_path, "language_model_attr + '.' + layers_attr")
    if not isinstance(layers, nn.ModuleList):
        raise ResolutionError(
            f"{layers_path} is a {type(layers).__name__}, not a ModuleList of decoder layers; the weight prefix is "
            "derived from it"
        )
    if len(layers) == 0:
        raise ResolutionError(f"{layers_path} is an empty ModuleList; the language model has no decoder layers")
    prefix = descriptor.weight_prefix
    names = [n for n, _ in model.named_parameters() if n.startswith(prefix)]
    if not names:
        sample = ", ".join(n for n, _ in list(model.named_parameters())[:3])
        raise ResolutionError(
            f"weight prefix {prefix!r} matches no parameter name of the model (its names look like: {sample})"
        )
    indices = {n[len(prefix) :].split(".", 1)[0] for n in names}
    expected = {str(i) for i in range(len(layers))}
    if indices != expected:
        raise ResolutionError(
            f"weight prefix {prefix!r}: parameter names cover layers {sorted(indices, key=lambda s: (len(s), s))}, "
            f"but {layers_path} holds {len(layers)}"
        )
    return layers


def resolve(
    model: nn.Module,
    overrides: Mapping[str, Any] | None = None,
    *,
    family: str | FamilyDescriptor | None = None,
) -> ResolvedFamily:
    """Resolve the family of ``model`` strictly and return its parts.

    The family is the one claiming ``model.config.model_type`` (or ``family``, which must claim it).
    ``overrides`` replace path fields of the descriptor for this model and are checked the same way.
    Every path, the derived weight prefix and every LoRA preset's patterns are checked; the first
    that does not fit raises `vlmreg.ResolutionError`.
    """
    model = _unwrap(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        raise ResolutionError(f"{type(model).__name__} has no config.model_type; vlmreg resolves transformers models")
    if isinstance(family, FamilyDescriptor):
        descriptor = family
    elif family is not None:
        descriptor = get_registry().get(family)
    else:
        descriptor = get_registry().for_model_type(model_type)
    if model_type not in descriptor.model_types:
        raise ResolutionError(
            f"family {descriptor.name!r} claims model_types {', '.join(descriptor.model_types)}, "
            f"but the model's config.model_type is {model_type!r}"
        )
    descriptor = _apply_overrides(descriptor, overrides)

    vision_encoder = resolve_module(model, descriptor.vision_encoder_attr, "vision_encoder_attr")
    language_model = resolve_module(model, descriptor.language_model_attr, "language_model_attr")
    lm_head = resolve_module(model, descriptor.lm_head_attr, "lm_head_attr")
    if not isinstance(getattr(lm_head, "weight", None), nn.Parameter):
        raise ResolutionError(
            f"lm_head_attr = {descriptor.lm_head_attr!r} resolves to a {type(lm_head).__name__} with no weight"
        )
    connectors = {path: resolve_module(model, path, "connector_attrs") for path in descriptor.connector_attrs}
    connector_parameters = _connector_parameters(model, descriptor)
    vision_blocks: nn.ModuleList | None = None
    if descriptor.vision_blocks_attr is not None:
        path = f"{descriptor.vision_encoder_attr}.{descriptor.vision_blocks_attr}"
        blocks = resolve_module(model, path, "vision_blocks_attr")
        if not isinstance(blocks, nn.ModuleList):
            raise ResolutionError(
                f"vision_blocks_attr: {path} is a {type(blocks).__name__}, not a ModuleList of blocks"
            )
        vision_blocks = blocks
    layers = _check_layers(model, descriptor)

    partial = ResolvedFamily(
        descriptor=descriptor,
        model=model,
        vision_encoder=vision_encoder,
        language_model=language_model,
        layers=layers,
        lm_head=lm_head,
        connectors=connectors,
        connector_parameters=connector_parameters,
        vision_blocks=vision_blocks,
        lora_presets={},
        overrides=dict(overrides or {}),
    )
    presets = {
        name: match_lora(model, name, preset, partial.scope_roots(), never=(descriptor.lm_head_attr,))
        for name, preset in descriptor.lora_presets.items()
    }
    return attrs.evolve(partial, lora_presets=presets)


def _connector_parameters(model: nn.Module, descriptor: FamilyDescriptor) -> dict[str, nn.Parameter]:
    """The descriptor's bare connector parameters, each a real parameter under no part the descriptor names already
    (one parameter counted twice would be trained, frozen or sent twice)."""
    named = (
        descriptor.vision_encoder_attr,
        descriptor.language_model_attr,
        descriptor.lm_head_attr,
        *descriptor.connector_attrs,
    )
    found: dict[str, nn.Parameter] = {}
    for path in descriptor.connector_parameters:
        parameter = resolve_parameter(model, path, "connector_parameters")
        inside = [root for root in named if path.startswith(root + ".")]
        if inside:
            raise ResolutionError(
                f"connector_parameters = {path!r} lies under {inside[0]!r}, a part the descriptor already names; "
                "list only parameters outside the vision tower, the language model, the lm_head and connector_attrs"
            )
        found[path] = parameter
    return found
