"""The model under its wrappers, and the class name a checkpoint of it must carry.

Training wraps a transformers model in ways that change what ``type(model)`` says: peft's ``PeftModel``,
``torch.compile``'s ``OptimizedModule`` (``_orig_mod``), DDP / FSDP1 (``module``), and FSDP2's ``fully_shard``, which
swaps the instance's class for a generated subclass named ``FSDP<Class>``. A config written for an inference engine
(vLLM picks its model implementation by ``architectures``) must name the model's own class, as transformers'
``save_pretrained`` of the unwrapped model does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["model_class", "model_class_name", "unwrapped"]


def unwrapped(model: Any) -> Any:
    """The innermost model under peft, ``torch.compile`` and DDP/FSDP1 wrappers (FSDP2 does not wrap: see
    `model_class`)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif type(model).__name__ in ("DistributedDataParallel", "FullyShardedDataParallel") and hasattr(
            model, "module"
        ):
            model = model.module
    return model


def model_class(model: Any) -> type:
    """The model's own class: unwrapped, and past the subclass FSDP2's ``fully_shard`` generates (the first class in its
    method resolution order that is not FSDP2's)."""
    cls = type(unwrapped(model))
    try:
        # deferred: optional, its absence is handled here
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415
    except ImportError:  # a torch without FSDP2
        return cls
    if issubclass(cls, FSDPModule):
        cls = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return cls


def model_class_name(model: Any) -> str:
    """``model_class(model).__name__``: what ``architectures`` in a saved config names."""
    return model_class(model).__name__
