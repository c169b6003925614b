"""Find a family's descriptor paths on the real transformers class, built on the meta device.

`build_on_meta` builds the image-text-to-text model of a ``model_type`` from its default config with no memory
and no weights; `find_layout` walks its module tree: the language model is the owner of the input embeddings,
its decoder layers the largest ``ModuleList`` under it, the vision tower and the connectors the other parts
next to it, the vision blocks the largest ``ModuleList`` under the tower, and the LoRA targets the ``nn.Linear``
names found in those parts. Nothing here guesses from a family's name: only the module tree is read.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from vlmreg.sdk.errors import VlmregError, did_you_mean

__all__ = ["FamilyLayout", "build_on_meta", "check_model_type", "find_layout", "image_text_class_name"]

_VISION_NAME = re.compile(r"vision|visual|vit|image", re.I)


@attrs.frozen
class FamilyLayout:
    """The descriptor paths and LoRA targets found on one model's module tree."""

    model_class: str
    vision_encoder_attr: str
    language_model_attr: str
    layers_attr: str
    lm_head_attr: str
    connector_attrs: tuple[str, ...]
    vision_blocks_attr: str | None
    num_layers: int
    language_linear: tuple[str, ...]
    language_expert_parameters: tuple[str, ...]
    connector_linear: tuple[str, ...]
    connector_parameters: tuple[str, ...]
    notes: tuple[str, ...] = ()


def check_model_type(model_type: str) -> None:
    """Refuse a ``model_type`` transformers does not know, or one without an image-text-to-text class."""
    # deferred: start-up cost (loads transformers)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # noqa: PLC0415

    if model_type not in CONFIG_MAPPING_NAMES:
        # deferred: start-up cost (loads transformers)
        import transformers  # noqa: PLC0415

        raise VlmregError(
            f"Unknown model type {model_type!r} in transformers {transformers.__version__}."
            f"{did_you_mean(model_type, CONFIG_MAPPING_NAMES)} A model type is the `model_type` of a checkpoint's "
            "config.json; transformers lists them in CONFIG_MAPPING."
        )
    if image_text_class_name(model_type) is None:
        # deferred: start-up cost (loads transformers)
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES  # noqa: PLC0415

        raise VlmregError(
            f"Model type {model_type!r} has no image-text-to-text class in transformers (AutoModelForImageTextToText "
            f"does not map it), so it is not a vision-language model vlmreg can train."
            f"{did_you_mean(model_type, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)}"
        )


def image_text_class_name(model_type: str) -> str | None:
    """The class ``AutoModelForImageTextToText`` builds for ``model_type``, or None."""
    # deferred: start-up cost (loads transformers)
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES  # noqa: PLC0415

    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


def build_on_meta(config: Any) -> Any:
    """The image-text-to-text model of ``config`` on the meta device (no memory, no weights)."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    # deferred: start-up cost (loads transformers)
    from transformers import AutoModelForImageTextToText  # noqa: PLC0415

    try:
        with torch.device("meta"):
            return AutoModelForImageTextToText.from_config(config)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise VlmregError(
            f"transformers cannot build {type(config).__name__} (model_type {config.model_type!r}) on the meta device: "
            f"{type(exc).__name__}: {first}"
        ) from exc


def _numel(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _path_of(model: Any, target: Any) -> str | None:
    return next((name for name, module in model.named_modules() if module is target and name), None)


def _largest_module_list(root: Any) -> tuple[str, Any] | None:
    # deferred: start-up cost (loads torch)
    from torch import nn  # noqa: PLC0415

    lists = [(name, m) for name, m in root.named_modules() if name and isinstance(m, nn.ModuleList) and len(m)]
    return max(lists, key=lambda item: (_numel(item[1]), len(item[1])), default=None)


def _linear_names(root: Any) -> tuple[str, ...]:
    """The last name segment of every ``nn.Linear`` under ``root``, in order of first appearance."""
    # deferred: start-up cost (loads torch)
    from torch import nn  # noqa: PLC0415

    return tuple(
        dict.fromkeys(name.rsplit(".", 1)[-1] for name, m in root.named_modules() if name and isinstance(m, nn.Linear))
    )


def _expert_parameters(layers: Any) -> tuple[str, ...]:
    """Parameters of 3 dimensions inside a decoder layer (fused MoE experts), as suffixes relative to the layer."""
    names: dict[str, None] = {}
    for layer in layers:
        for name, parameter in layer.named_parameters():
            if parameter.dim() == 3:
                names[name] = None
    return tuple(names)


def _own_parameters(module: Any) -> tuple[str, ...]:
    """Matrices a connector holds directly, not inside an ``nn.Linear`` (LoRA reaches them as parameters)."""
    # deferred: start-up cost (loads torch)
    from torch import nn  # noqa: PLC0415

    return tuple(
        f"{owner}.{name}".lstrip(".") if owner else name
        for owner, sub in module.named_modules()
        if not isinstance(sub, nn.Linear)
        for name, p in sub.named_parameters(recurse=False)
        if p.dim() == 2 and not isinstance(sub, nn.Embedding)
    )


def find_layout(model: Any) -> FamilyLayout:
    """Read the descriptor paths off ``model``'s module tree; `VlmregError` when a part cannot be found."""
    cls = type(model).__name__
    embeddings = model.get_input_embeddings()
    embed_path = _path_of(model, embeddings) if embeddings is not None else None
    if embed_path is None or "." not in embed_path:
        raise VlmregError(f"{cls}: cannot find the language model (no input embeddings inside a submodule)")
    language_attr = embed_path.rsplit(".", 1)[0]
    language = model.get_submodule(language_attr)
    found = _largest_module_list(language)
    if found is None:
        raise VlmregError(f"{cls}: the language model {language_attr} holds no ModuleList of decoder layers")
    layers_attr, layers = found

    head = model.get_output_embeddings()
    head_path = _path_of(model, head) if head is not None else None
    if head_path is None:
        raise VlmregError(f"{cls}: cannot find the lm_head (get_output_embeddings() is not a submodule)")

    base_attr = language_attr.rsplit(".", 1)[0] if "." in language_attr else ""
    base = model.get_submodule(base_attr) if base_attr else model
    prefix = f"{base_attr}." if base_attr else ""
    parts = [
        (name, child)
        for name, child in base.named_children()
        if child is not language and prefix + name != head_path and _numel(child) > 0
    ]
    if not parts:
        raise VlmregError(f"{cls}: no vision tower next to the language model {language_attr}")
    with_blocks = [(n, c) for n, c in parts if _largest_module_list(c) is not None]
    named = [(n, c) for n, c in with_blocks if _VISION_NAME.search(n)]
    vision_name, vision = max(named or with_blocks or parts, key=lambda item: _numel(item[1]))
    connectors = [(prefix + n, c) for n, c in parts if n != vision_name]
    blocks = _largest_module_list(vision)
    notes = []
    if not connectors:
        notes.append(
            "no connector next to the vision tower: the projector is inside it (or absent); name it in connector_attrs "
            "if LoRA presets should reach it"
        )
    return FamilyLayout(
        model_class=cls,
        vision_encoder_attr=prefix + vision_name,
        language_model_attr=language_attr,
        layers_attr=layers_attr,
        lm_head_attr=head_path,
        connector_attrs=tuple(path for path, _ in connectors),
        vision_blocks_attr=blocks[0] if blocks else None,
        num_layers=len(layers),
        language_linear=_linear_names(layers),
        language_expert_parameters=_expert_parameters(layers),
        connector_linear=tuple(dict.fromkeys(n for _, c in connectors for n in _linear_names(c))),
        connector_parameters=tuple(dict.fromkeys(n for _, c in connectors for n in _own_parameters(c))),
        notes=tuple(notes),
    )
