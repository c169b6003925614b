"""Building a family's model from a transformers config: random weights, or on the meta device.

The meta device allocates no memory and reads no weights, so ``vlmreg check`` resolves the module
tree of a 235B checkpoint's config in seconds.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vlmreg.config.hub import config_dict, config_file, read_model_type
from vlmreg.sdk.descriptor import FamilyDescriptor
from vlmreg.sdk.errors import ResolutionError, VlmregError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["build_model", "load_config", "model_class_for", "read_model_type", "shallower", "tiny_config_of"]


def model_class_for(descriptor: FamilyDescriptor) -> Any:
    """The class that builds the family's models: ``descriptor.model_class``, else ``AutoModelForImageTextToText``."""
    if descriptor.model_class is None:
        # deferred: start-up cost (loads transformers)
        from transformers import AutoModelForImageTextToText  # noqa: PLC0415

        return AutoModelForImageTextToText
    module_name, _, class_name = descriptor.model_class.partition(":")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ResolutionError(
            f"family {descriptor.name!r}: model_class {descriptor.model_class!r} cannot be imported ({exc})"
        ) from None


def tiny_config_of(descriptor: FamilyDescriptor) -> Any:
    """Call the descriptor's ``tiny_config`` and check it returns a transformers config the family claims."""
    try:
        config = descriptor.tiny_config()
    except Exception as exc:
        raise VlmregError(f"family {descriptor.name!r}: tiny_config() raised {type(exc).__name__}: {exc}") from exc
    model_type = getattr(config, "model_type", None)
    if model_type not in descriptor.model_types:
        raise VlmregError(
            f"family {descriptor.name!r}: tiny_config() returned a {type(config).__name__} with model_type "
            f"{model_type!r}, which the family does not claim ({', '.join(descriptor.model_types)})"
        )
    return config


def shallower(config: Any, layers: int | None, *, what: str) -> Any:
    """``config`` with only its first ``layers`` decoder layers (``None``: unchanged): the text config's
    ``num_hidden_layers``, and its per-layer lists (``layer_types``, ``mlp_only_layers``) cut to match. Every other
    dimension stays the shape's. ``what`` names the shape in errors."""
    if layers is None:
        return config
    text = config.get_text_config()
    depth = getattr(text, "num_hidden_layers", None)
    if depth is None:
        raise VlmregError(f"{what}: its text config has no num_hidden_layers, so layers = {layers} cannot apply")
    if not 1 <= layers <= depth:
        raise VlmregError(f"{what}: layers = {layers}, but the shape has {depth} decoder layers (choose 1 to {depth})")
    text.num_hidden_layers = layers
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:layers]
    if isinstance(getattr(text, "mlp_only_layers", None), list):
        text.mlp_only_layers = [i for i in text.mlp_only_layers if i < layers]
    return config


def build_model(
    config: Any, descriptor: FamilyDescriptor, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """Instantiate the family's model class from ``config`` with random weights (``device="meta"``: no memory)."""
    cls = model_class_for(descriptor)
    factory = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    kwargs = {"dtype": dtype} if dtype is not None else {}
    with torch.device(device):
        model = factory(config, **kwargs)
    if descriptor.init_random_weights is not None and torch.device(device).type != "meta":
        with torch.no_grad():
            descriptor.init_random_weights(model)
    return model


def load_config(target: str | Path) -> Any:
    """A transformers config from a local model directory or a ``config.json`` file; never the network."""
    # deferred: start-up cost (loads transformers)
    from transformers import AutoConfig  # noqa: PLC0415

    file = config_file(target)
    data = config_dict(file)
    try:
        if Path(target).is_dir():
            return AutoConfig.from_pretrained(target, local_files_only=True)
        model_type = data.pop("model_type")
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as exc:
        # deferred: start-up cost (loads transformers)
        import transformers  # noqa: PLC0415

        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise VlmregError(
            f"{file}: transformers {transformers.__version__} cannot read this config ({first_line})"
        ) from None
