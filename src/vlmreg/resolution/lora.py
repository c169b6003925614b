"""Matching LoRA presets (and explicit target lists) against the resolved parts of a model.

peft raises only when nothing at all matches and is silent about a list entry that matches nothing,
so every pattern is checked here, on its own, before peft sees it. The result is a list of full
module and parameter names that peft matches exactly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import attrs
from torch import nn

from vlmreg.sdk.descriptor import ALL_LINEAR, LoraPreset
from vlmreg.sdk.errors import ResolutionError

__all__ = ["LoraTargetSet", "adapted_names", "match_lora", "match_lora_regex"]

# Module types peft's LoRA can wrap by name. Conv1D is transformers' GPT-2 style linear.
_ADAPTABLE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _adaptable(module: nn.Module) -> bool:
    return isinstance(module, _ADAPTABLE) or type(module).__name__ == "Conv1D"


def _peft_internal(name: str) -> bool:
    """Modules peft adds inside an adapted layer (``lora_A``, ``lora_dropout``, ...), which are never targets."""
    return any(part.startswith("lora_") for part in name.split("."))


def _base_name(name: str) -> str:
    """The name a module or parameter had before peft wrapped its layer in ``base_layer``."""
    return name.replace(".base_layer", "")


def _suffix_match(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern)


def _under(name: str, roots: Iterable[str]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def _count_dict(matches: Mapping[str, int]) -> dict[str, int]:
    return dict(matches)


@attrs.frozen
class LoraTargetSet:
    """The exact modules and parameters a LoRA preset (or explicit list) reaches on one model."""

    name: str
    modules: tuple[str, ...]
    parameters: tuple[str, ...]
    matches: Mapping[str, int] = attrs.field(converter=_count_dict)
    reaches_vision: bool

    def peft_kwargs(self) -> dict[str, list[str]]:
        """``target_modules`` / ``target_parameters`` for a ``peft.LoraConfig`` (full names, matched exactly)."""
        kwargs: dict[str, list[str]] = {"target_modules": list(self.modules)}
        if self.parameters:
            kwargs["target_parameters"] = list(self.parameters)
        return kwargs


def match_lora(
    model: nn.Module,
    name: str,
    preset: LoraPreset,
    scope_roots: Mapping[str, Sequence[str]],
    *,
    never: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> LoraTargetSet:
    """Match ``preset`` inside its scopes; every pattern must reach something, or `ResolutionError`.

    ``scope_roots`` maps each scope name to the module paths it covers; ``never`` lists module paths
    never adapted (the lm_head); ``exclude`` lists suffix patterns dropped after matching.
    """
    roots: list[str] = []
    for scope in preset.scopes:
        paths = scope_roots.get(scope, ())
        if not paths:
            hint = "set the descriptor's connector_attrs, or " if scope == "connectors" else ""
            raise ResolutionError(
                f"LoRA target {name!r} reaches scope {scope!r}, but the family resolves no module for it; "
                f"{hint}drop {scope!r} from the target's scopes"
            )
        roots.extend(paths)

    counts = {p: 0 for p in preset.modules} | {p: 0 for p in preset.parameters}
    excluded_counts = {p: 0 for p in exclude}
    modules: list[str] = []
    for module_name, module in model.named_modules():
        if not _under(module_name, roots) or _under(module_name, never):
            continue
        if _peft_internal(module_name) or module_name.endswith(".base_layer"):
            continue
        module = getattr(module, "base_layer", module)  # an already adapted layer counts as what it wraps
        hits = [
            p
            for p in preset.modules
            if (p == ALL_LINEAR and isinstance(module, nn.Linear))
            or (p != ALL_LINEAR and _suffix_match(module_name, p))
        ]
        if not hits:
            continue
        if not _adaptable(module):
            if all(p == ALL_LINEAR for p in hits):
                continue
            raise ResolutionError(
                f"LoRA target {name!r}: pattern {hits[0]!r} matches {module_name!r} ({type(module).__name__}), "
                "which peft cannot adapt; name its linear layers instead"
            )
        dropped = [p for p in exclude if _suffix_match(module_name, p)]
        for p in dropped:
            excluded_counts[p] += 1
        for p in hits:
            counts[p] += 1
        if not dropped:
            modules.append(module_name)

    parameters: list[str] = []
    if preset.parameters:
        for param_name, _ in model.named_parameters():
            if not _under(param_name, roots) or _peft_internal(param_name):
                continue
            param_name = _base_name(param_name)
            hits = [p for p in preset.parameters if _suffix_match(param_name, p)]
            for p in hits:
                counts[p] += 1
            if hits and not any(_suffix_match(param_name, p) for p in exclude) and param_name not in parameters:
                parameters.append(param_name)

    missing = [p for p, n in counts.items() if n == 0]
    if missing:
        raise ResolutionError(
            f"LoRA target {name!r}: {', '.join(repr(p) for p in missing)} matches nothing under "
            f"{', '.join(roots)}. peft would skip it silently; fix or remove it"
        )
    unused = [p for p, n in excluded_counts.items() if n == 0]
    if unused:
        raise ResolutionError(
            f"LoRA exclude pattern {', '.join(repr(p) for p in unused)} matches no target of {name!r}"
        )
    if not modules and not parameters:
        raise ResolutionError(f"LoRA target {name!r}: every matched module was excluded; nothing is left to adapt")
    vision_roots = scope_roots.get("vision_encoder", ())
    connector_roots = scope_roots.get("connectors", ())
    reaches_vision = any(_under(m, vision_roots) and not _under(m, connector_roots) for m in [*modules, *parameters])
    return LoraTargetSet(
        name=name, modules=tuple(modules), parameters=tuple(parameters), matches=counts, reaches_vision=reaches_vision
    )


def match_lora_regex(
    model: nn.Module,
    pattern: str,
    scope_roots: Mapping[str, Sequence[str]],
    scopes: Sequence[str],
    *,
    never: Sequence[str] = (),
) -> LoraTargetSet:
    """Modules inside ``scopes`` whose full name matches ``pattern`` (``re.fullmatch``); at least one, all adaptable."""

    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ResolutionError(f"LoRA targets: {pattern!r} is not a valid regular expression ({exc})") from None
    roots = [root for scope in scopes for root in scope_roots.get(scope, ())]
    modules = []
    for module_name, module in model.named_modules():
        if not _under(module_name, roots) or _under(module_name, never) or _peft_internal(module_name):
            continue
        if module_name.endswith(".base_layer") or not regex.fullmatch(module_name):
            continue
        if not _adaptable(getattr(module, "base_layer", module)):
            raise ResolutionError(
                f"LoRA targets: re:{pattern} matches {module_name!r} ({type(module).__name__}), which peft cannot adapt"
            )
        modules.append(module_name)
    if not modules:
        raise ResolutionError(f"LoRA targets: re:{pattern} matches no module name under {', '.join(roots)}")
    vision = scope_roots.get("vision_encoder", ())
    connectors = scope_roots.get("connectors", ())
    return LoraTargetSet(
        name=f"re:{pattern}",
        modules=tuple(modules),
        parameters=(),
        matches={f"re:{pattern}": len(modules)},
        reaches_vision=any(_under(m, vision) and not _under(m, connectors) for m in modules),
    )


def adapted_names(peft_model: nn.Module) -> set[str]:
    """Base-model names of the modules (and parameter hosts) a peft model adapted."""
    # deferred: start-up cost (loads peft)
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415

    return {
        _base_name(name.removeprefix("base_model.model."))
        for name, module in peft_model.named_modules()
        if isinstance(module, LoraLayer) and not name.endswith(".base_layer")
    }
