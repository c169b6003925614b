"""Adapter syncs into vLLM (verified against vLLM 0.24.0's source): LoRA that reaches the workers through vlmreg's
transports and is served as vLLM's own runtime-loaded adapter.

vLLM loads an adapter when the API server is asked to (``/v1/load_lora_adapter``, with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): each worker's LoRA manager builds it with its ``LoRAModel`` class's
``from_local_checkpoint(path, ...)`` (``WorkerLoRAManager._lora_model_cls``). A vlmreg sync brings the adapter factors
to each worker first, over the run's transport (IPC, NCCL, gloo), under peft's names; the worker keeps them by the
adapter's directory (`stage`), and `StagedLoRAModel` (installed by `install`) builds the adapter from those tensors
instead of reading the directory, whose ``adapter_config.json`` (rank, alpha) it still reads.

Two ways a run's versions reach vLLM (`take_adapter`):

- live (the default): the first version is staged in a GPU buffer of the worker (`vlmreg.inference.vllm_lora_live`)
  and loaded once under one name; every later sync rewrites that adapter in place, in the buffer and in its GPU
  slot, with no request to the API server (``fields["lora_mode"]``: ``"live"`` for the first, ``"update"`` after);
- versioned (``VLMREG_LORA_LIVE=0`` in vLLM's environment, or a vLLM whose LoRA manager lacks what the live adapter
  uses): each version is staged on the CPU and loaded as a new adapter.

An adapter asked for again with nothing staged (vLLM reloading one it evicted) is the live adapter when it is the
live one's directory; otherwise it is read from its files, which hold only its config: vLLM then reports the error.

Which modules vLLM serves as LoRA is read off its LoRA manager (`served_modules`): the modules it wrapped, which
include the vision tower and connector only when the model supports them (``get_num_mm_encoder_tokens``) and the
server runs with ``--enable-tower-connector-lora``. Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["LIVE", "STAGED", "install", "lora_manager_of", "served_modules", "stage", "take_adapter"]

#: Adapter directory (real path) -> what a sync staged for it and vLLM has not built yet: {peft name: CPU tensor}, or
#: a `vlmreg.inference.vllm_lora_live.LiveAdapter`.
STAGED: dict[str, Any] = {}
#: Adapter directory (real path) -> the live adapter vLLM built from it (one a worker).
LIVE: dict[str, Any] = {}
_LOCK = threading.Lock()


def stage(path: str, pairs: Iterable[tuple[str, Any]], *, live: bool = False, device: Any = None) -> int:
    """Keep copies of one sync's adapter factors for ``path`` (on the CPU, where vLLM builds adapters, or, ``live``,
    in a `LiveAdapter`'s buffer on ``device``); returns how many."""
    if live:
        # deferred: start-up cost (loads torch)
        from vlmreg.inference.vllm_lora_live import LiveAdapter  # noqa: PLC0415

        staged: Any = LiveAdapter(pairs, device)
        count = len(staged.names)
    else:
        staged = {name: tensor.detach().to("cpu", copy=True) for name, tensor in pairs}
        count = len(staged)
    with _LOCK:
        STAGED.clear()  # only the newest version is ever asked for next
        STAGED[os.path.realpath(path)] = staged
    return count


def take_adapter(path: str, mode: str | None, pairs: list[tuple[str, Any]], model: Any, device: Any) -> str:
    """One sync's adapter factors for the adapter of directory ``path``: staged for vLLM's next load (``mode`` None:
    versioned, on the CPU; ``"live"``: in a live buffer), or (``"update"``) written into the live adapter; returns
    what was done, for the worker's log."""
    if mode == "update":
        with _LOCK:
            live = LIVE.get(os.path.realpath(path))
        if live is None:
            raise RuntimeError(
                f"vlmreg: no live LoRA adapter was loaded from {path} in this worker (vLLM restarted since the "
                "trainer's first sync?)"
            )
        return f"{len(pairs)} adapter tensors {live.update(lora_manager_of(model), pairs)}"
    if mode not in (None, "live"):
        raise ValueError(f"vlmreg: unknown lora_mode {mode!r} (expected 'live' or 'update')")
    return f"{stage(path, pairs, live=mode == 'live', device=device)} adapter tensors staged"


def lora_manager_of(model: Any) -> Any:
    """vLLM's ``LoRAModelManager`` of a worker's model (it sets itself as the model's ``lora_manager``), through
    any CUDA-graph wrapper."""
    while (
        model is not None and getattr(model, "lora_manager", None) is None and callable(getattr(model, "unwrap", None))
    ):
        model = model.unwrap()
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise RuntimeError(
            "vlmreg: this vLLM worker's model has no LoRA manager (was vLLM started with --enable-lora?)"
        )
    return manager


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
            real = os.path.realpath(lora_dir)
            with _LOCK:
                tensors = STAGED.pop(real, None)
                live = LIVE.get(real)
            if hasattr(tensors, "build"):  # a live adapter's first version: vLLM's adapter over its buffer
                model = tensors.build(cls, peft_helper, **kwargs)
                with _LOCK:
                    LIVE.clear()
                    LIVE[real] = tensors
                return model
            if tensors is None and live is not None and live.id == kwargs.get("lora_model_id"):
                return live.model  # vLLM reloading the live adapter it evicted: the current version
            if tensors is None:
                return super().from_local_checkpoint(lora_dir, expected_lora_modules, peft_helper, **kwargs)
            keep = ("device", "dtype", "model_vocab_size", "weights_mapper", "skip_prefixes")
            return cls.from_lora_tensors(
                kwargs.get("lora_model_id"), tensors, peft_helper, **{k: kwargs[k] for k in keep if k in kwargs}
            )

    return StagedLoRAModel
