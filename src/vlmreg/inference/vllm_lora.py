"""Adapter syncs into vLLM (verified against vLLM 0.24.0's source): LoRA that reaches the workers through vlmreg's
transports and is served as vLLM's own runtime-loaded adapter.

vLLM loads an adapter when the API server is asked to (``/v1/load_lora_adapter``, with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): each worker's LoRA manager builds it with its ``LoRAModel`` class's
``from_local_checkpoint(path, ...)`` (``WorkerLoRAManager._lora_model_cls``). A vlmreg sync brings the adapter factors
to each worker first, over the run's transport (IPC, NCCL, gloo), under peft's names; the worker keeps them by the
adapter's directory (`stage`), and `StagedLoRAModel` (installed by `install`) builds the adapter from those tensors
instead of reading the directory, whose ``adapter_config.json`` (rank, alpha) it still reads. An adapter asked for
with nothing staged (vLLM reloading an evicted one) is read from its files, which the trainer writes for every step.

Which modules vLLM serves as LoRA is read off its LoRA manager (`served_modules`): the modules it wrapped, which
include the vision tower and connector only when the model supports them (``get_num_mm_encoder_tokens``) and the
server runs with ``--enable-tower-connector-lora``. Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["STAGED", "install", "served_modules", "stage"]

#: Adapter directory (real path) -> {peft name: CPU tensor} received for it and not yet built by vLLM.
STAGED: dict[str, dict[str, Any]] = {}
_LOCK = threading.Lock()


def stage(path: str, pairs: Iterable[tuple[str, Any]]) -> int:
    """Keep copies (on the CPU, where vLLM builds adapters) of one sync's adapter factors for ``path``; returns how
    many."""
    tensors = {name: tensor.detach().to("cpu", copy=True) for name, tensor in pairs}
    with _LOCK:
        STAGED.clear()  # only the newest version is ever asked for next
        STAGED[os.path.realpath(path)] = tensors
    return len(tensors)


def served_modules(manager: Any, names: Iterable[str]) -> list[str]:
    """Of ``names`` (the trainer's adapted modules, in-memory Hugging Face names), those vLLM's LoRA model manager
    wrapped: mapped by the model's ``hf_to_vllm_mapper``, a module vLLM packs into a fused one (its
    ``packed_modules_mapping``) found under the fused name."""
    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    packed: Mapping[str, list[str]] = getattr(manager, "packed_modules_mapping", {}) or {}
    wrapped = set(manager.modules)
    served = []
    for name in names:
        mapped = mapper.apply_list([name]) if mapper is not None else [name]
        if not mapped:
            continue
        prefix, _, last = mapped[0].rpartition(".")
        candidates = {mapped[0]} | {
            f"{prefix}.{fused}" if prefix else fused for fused, parts in packed.items() if last in parts
        }
        if candidates & wrapped:
            served.append(name)
    return served


def install(worker_lora_manager: Any) -> None:
    """Make this worker's LoRA manager build adapters from staged tensors (`StagedLoRAModel`)."""
    base = worker_lora_manager._lora_model_cls
    if getattr(base, "_vlmreg_staged", False):
        return
    worker_lora_manager._lora_model_cls = _staged_class(base)


def _staged_class(base: Any) -> Any:
    class StagedLoRAModel(base):
        """vLLM's ``LoRAModel``, built from the tensors a vlmreg sync staged for the directory when there are any."""

        _vlmreg_staged = True

        @classmethod
        def from_local_checkpoint(
            cls, lora_dir: str, expected_lora_modules: Any, peft_helper: Any, **kwargs: Any
        ) -> Any:
            with _LOCK:
                tensors = STAGED.pop(os.path.realpath(lora_dir), None)
            if tensors is None:
                return super().from_local_checkpoint(lora_dir, expected_lora_modules, peft_helper, **kwargs)
            keep = ("device", "dtype", "model_vocab_size", "weights_mapper", "skip_prefixes")
            return cls.from_lora_tensors(
                kwargs.get("lora_model_id"), tensors, peft_helper, **{k: kwargs[k] for k in keep if k in kwargs}
            )

    return StagedLoRAModel
