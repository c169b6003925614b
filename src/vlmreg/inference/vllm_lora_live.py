"""The run's LoRA adapter in a vLLM worker, kept live: each sync rewrites it where vLLM computes with it.

Loading each version through ``/v1/load_lora_adapter`` took 1.2-1.4 s a sync on the 2B config (vLLM 0.24, language
preset, rank 16), of which the transfer was 30-85 ms: the rest is vLLM's load path, run for every version (an API
request, the engine's utility call, 392 host tensors pinned one by one, the fused modules packed and ``lora_B``
scaled on the CPU, every factor copied to its GPU slot, then an unload request). None of it is needed when only the
values change. So the first version is loaded once through that path, built from a GPU buffer this worker owns
(`LiveAdapter.build`: vLLM's own ``from_lora_tensors``, whose ``LoRALayerWeights`` then hold views of the buffer, and
``lora_B`` is scaled in place in it when vLLM packs the adapter), and every later sync (`LiveAdapter.update`):

1. copies the incoming factors into the buffer and scales its ``lora_B`` part as vLLM did (one grouped copy, one
   multiply): the adapter vLLM registered now holds the new version, for whenever vLLM copies it into a slot;
2. when the adapter sits in a GPU slot (it does after its first request), writes that slot: the first time by
   running, at the slot's index, what vLLM's ``LoRAModelManager.activate_adapter`` runs for each wrapped module
   (``set_lora``, or ``reset_lora`` for a module the adapter lacks), under a `torch.overrides.TorchFunctionMode`
   that records every copy from the buffer into vLLM's stacked LoRA tensors; later syncs replay those copies
   (`vlmreg.broadcast.copy_plan.GroupedCopies`), and the first replay is checked against vLLM's own ``set_lora``
   (bitwise). The recording is strict (any other in-place change of a stacked tensor, a copy from memory outside
   the buffer, a factor never copied, or a stacked tensor changed with no recorded write refuses it: every sync
   then runs the ``set_lora`` loop, a few milliseconds).

The constant writes ``reset_lora`` makes are not replayed: a slot's shape never changes between syncs, so the
regions they zeroed stay zero (only ``set_lora`` and ``reset_lora`` of the adapter holding the slot write it, and a
slot given to another adapter and back is rewritten by vLLM from the buffer and recorded afresh).

The adapter keeps its name and its place in vLLM's caches across versions; what tells versions apart for caching is
the trainer's `vlmreg.inference.cache_scope.CacheScope` (a new ``cache_salt`` and image ``uuid``s per version), and
no request runs during a sync (the trainer's syncs exclude rollouts). ``VLMREG_LORA_LIVE=0`` in vLLM's environment
turns this off: every version is then loaded through the API (`vlmreg.inference.vllm_lora`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from vlmreg.broadcast.copy_plan import GroupedCopies

__all__ = ["LIVE_ENV", "LiveAdapter", "SlotPlanRefused", "live_supported", "stacked_tensors", "write_slots"]

#: Set to ``0`` in vLLM's environment to load every adapter version through ``/v1/load_lora_adapter``.
LIVE_ENV = "VLMREG_LORA_LIVE"
_A = ".lora_A.weight"
_IN_PLACE_DUNDERS = frozenset(
    (
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__ipow__",
        "__iand__",
        "__ior__",
    )
)


def live_supported(adapter_manager: Any) -> bool:
    """Whether this worker can keep the adapter live: not turned off, and vLLM's manager has what it needs."""
    if os.environ.get(LIVE_ENV, "1") == "0" or adapter_manager is None:
        return False
    return all(hasattr(adapter_manager, a) for a in ("modules", "lora_index_to_id", "get_adapter", "add_adapter"))


class SlotPlanRefused(Exception):
    """Writing the slots did something a replay of copies could not repeat; the message says what."""


def stacked_tensors(adapter_manager: Any) -> dict[int, tuple[str, torch.Tensor]]:
    """Storage address -> (owner, tensor) of every stacked LoRA tensor of vLLM's wrapped modules (``lora_a_stacked``,
    ``lora_b_stacked`` and their kin): where adapters live on the GPU."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for name, module in adapter_manager.modules.items():
        for attr, value in vars(module).items():
            if not (attr.startswith("lora_") and attr.endswith("_stacked")):
                continue
            values = value if isinstance(value, (tuple, list)) else (value,)
            for i, tensor in enumerate(values):
                if isinstance(tensor, torch.Tensor):
                    found.setdefault(_storage(tensor), (f"{name}.{attr}[{i}]", tensor))
    return found


def write_slots(adapter_manager: Any, lora_model: Any, index: int) -> None:
    """Write ``lora_model`` into slot ``index`` of every wrapped module, as vLLM's ``activate_adapter`` does."""
    for name, module in adapter_manager.modules.items():
        weights = lora_model.get_lora(name)
        if not weights:
            module.reset_lora(index)
        else:
            module.set_lora(index, weights.lora_a, weights.lora_b)


class LiveAdapter:
    """One worker's copy of the run's adapter factors (peft names), and how they reach vLLM's slots."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]], device: Any = None) -> None:
        pairs = list(pairs)
        if not pairs:
            raise ValueError("vlmreg live LoRA: a sync staged no adapter factors")
        # every lora_A first, then every lora_B: one contiguous region to scale
        names = sorted((n for n, _ in pairs), key=lambda n: not n.endswith(_A))
        shapes = {n: tuple(t.shape) for n, t in pairs}
        self.names, self.shapes = names, shapes
        self.dtype = pairs[0][1].dtype
        self.device = torch.device(device) if device is not None else pairs[0][1].device
        self._allocate(self.dtype)
        self.model: Any = None  # vLLM's LoRAModel built from the buffer
        self.id: int | None = None
        self.scaling = 1.0  # what vLLM multiplies lora_B by (set once it has packed the adapter)
        self.scaled = False
        self.plans: dict[int, GroupedCopies] = {}  # slot index -> recorded copies
        self.verified: set[int] = set()
        self.refused: str | None = None
        self.syncs = 0
        self._copy(pairs)

    def _allocate(self, dtype: torch.dtype) -> None:
        sizes = [int(torch.Size(self.shapes[n]).numel()) for n in self.names]
        self.buffer = torch.empty(sum(sizes), dtype=dtype, device=self.device)
        self.views = {
            n: v.view(self.shapes[n]) for n, v in zip(self.names, torch.split(self.buffer, sizes), strict=True)
        }
        a = sum(s for n, s in zip(self.names, sizes, strict=True) if n.endswith(_A))
        self.b_region = self.buffer[a:]

    def _copy(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
        incoming = dict(pairs)
        if incoming.keys() != self.views.keys() or any(tuple(t.shape) != self.shapes[n] for n, t in pairs):
            missing = sorted(set(self.views) ^ set(incoming)) or [
                n for n, t in pairs if tuple(t.shape) != self.shapes[n]
            ]
            raise ValueError(
                f"vlmreg live LoRA: this sync's adapter factors differ from the live adapter's ({missing[0]}); "
                "the trainer's LoRA changed shape (restart vLLM)"
            )
        with torch.no_grad():
            torch._foreach_copy_([self.views[n] for n in self.names], [incoming[n].detach() for n in self.names])
            if self.scaled and self.scaling != 1:
                self.b_region.mul_(self.scaling)

    def build(self, model_cls: Any, peft_helper: Any, *, lora_model_id: int, **kwargs: Any) -> Any:
        """vLLM's ``LoRAModel`` over the buffer (``kwargs``: the rest of ``from_local_checkpoint``'s; its ``device``
        is ignored: the factors stay on this GPU)."""
        dtype = kwargs.get("dtype")
        if isinstance(dtype, torch.dtype) and dtype != self.dtype:  # vLLM's lora_dtype: the buffer takes it
            old = dict(self.views)
            self.dtype = dtype
            self._allocate(dtype)
            self._copy(list(old.items()))
        keep = {k: kwargs[k] for k in ("model_vocab_size", "weights_mapper", "skip_prefixes") if k in kwargs}
        self.model = model_cls.from_lora_tensors(
            lora_model_id, dict(self.views), peft_helper, device=self.device, dtype=self.dtype, **keep
        )
        self.id = lora_model_id
        self.scaling = float(getattr(peft_helper, "vllm_lora_scaling_factor", 1.0))
        self.scaled = True  # vLLM scales the buffer's lora_B views when it packs the adapter (add_adapter)
        return self.model

    def update(self, adapter_manager: Any, pairs: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Take one sync's factors; returns how they reached vLLM (for the worker's log)."""
        if self.model is None or self.id is None:
            raise RuntimeError("vlmreg live LoRA: vLLM never built the live adapter (was it loaded?)")
        self._copy(list(pairs))
        self.syncs += 1
        if self.syncs == 1:
            self._check_views()
        registered = adapter_manager.get_adapter(self.id)
        if registered is None:  # evicted from vLLM's adapter cache: registered again, from the buffer
            adapter_manager.add_adapter(self.model)
            return "re-registered (vLLM had evicted it)"
        if registered is not self.model:
            raise RuntimeError(
                f"vlmreg live LoRA: vLLM holds another adapter under id {self.id}; restart vLLM (or set "
                f"{LIVE_ENV}=0 in its environment)"
            )
        ids = list(adapter_manager.lora_index_to_id)
        if self.id not in ids:
            return "refreshed (in no GPU slot: vLLM copies it there for its next request)"
        index = ids.index(self.id)
        plan = self.plans.get(index)
        if plan is not None:
            plan.run()
            if index not in self.verified:
                return self._verify(adapter_manager, index)
            return "replayed"
        if self.refused is not None:
            write_slots(adapter_manager, self.model, index)
            return "written with set_lora"
        try:
            self.plans[index] = self._record(adapter_manager, index)
        except SlotPlanRefused as exc:
            self.refused = str(exc)
            _log(f"adapter slots are written with vLLM's set_lora every sync (no copy plan: {exc})")
            return "written with set_lora"
        return f"recorded ({len(self.plans[index].copies)} copies)"

    def _check_views(self) -> None:
        """Every factor vLLM's adapter holds must be a view of the buffer, or updates would not reach it."""
        storage = _storage(self.buffer)
        for name, weights in self.model.loras.items():
            for part in (weights.lora_a, weights.lora_b):
                for tensor in part if isinstance(part, (list, tuple)) else (part,):
                    if tensor is not None and _storage(tensor) != storage:
                        raise RuntimeError(
                            f"vlmreg live LoRA: vLLM's adapter holds {name} outside the live buffer (a copy), so "
                            f"updates would not reach it; set {LIVE_ENV}=0 in vLLM's environment"
                        )

    def _record(self, adapter_manager: Any, index: int) -> GroupedCopies:
        """Write slot ``index`` with vLLM's own loop, recording its copies; `SlotPlanRefused` if a replay would
        differ (the slot is written either way)."""
        destinations = stacked_tensors(adapter_manager)
        before = _checksums(t for _, t in destinations.values())
        recorder = _SlotRecorder(_storage(self.buffer), destinations)
        with recorder:
            write_slots(adapter_manager, self.model, index)
        if recorder.refused:
            raise SlotPlanRefused(recorder.refused)
        unused = self._uncopied(recorder.copies)
        if unused:
            raise SlotPlanRefused(f"{len(unused)} factor(s) never copied into a slot (first: {unused[0]})")
        after = _checksums(t for _, t in destinations.values())
        written = recorder.written
        for (address, (owner, _)), old, new in zip(destinations.items(), before, after, strict=True):
            if address not in written and not torch.equal(old, new):
                raise SlotPlanRefused(f"{owner} changed with no recorded write")
        return GroupedCopies(recorder.copies)

    def _uncopied(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
        """Factors no recorded copy reads (with tensor parallelism each worker copies its shard: some of it)."""
        size = self.buffer.element_size()
        spans = sorted((src.data_ptr(), src.data_ptr() + _extent(src)) for _, src in copies)
        unused = []
        for name in self.names:
            view = self.views[name]
            start, end = view.data_ptr(), view.data_ptr() + view.numel() * size
            if not any(s < end and start < e for s, e in spans):
                unused.append(name)
        return unused

    def _verify(self, adapter_manager: Any, index: int) -> str:
        """The first replay of a slot, checked against vLLM's own ``set_lora`` (bitwise)."""
        slots = [t[index] for _, t in stacked_tensors(adapter_manager).values() if t.dim() and t.shape[0] > index]
        replayed = [s.clone() for s in slots]
        write_slots(adapter_manager, self.model, index)
        differ = sum(not torch.equal(a, b) for a, b in zip(replayed, slots, strict=True))
        self.verified.add(index)
        if differ:
            self.refused = f"the replay differed from vLLM's set_lora in {differ} stacked tensor(s)"
            del self.plans[index]
            _log(f"adapter slots: {self.refused}; written with set_lora from now on")
            return "written with set_lora (replay refused)"
        _log(f"adapter slots: the replay equals vLLM's set_lora ({len(slots)} stacked tensors)")
        return "replayed (checked against set_lora)"


class _SlotRecorder(TorchFunctionMode):
    """Keeps the copies from the live buffer into vLLM's stacked tensors; notes anything a replay would miss."""

    def __init__(self, source: int, destinations: dict[int, tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.source, self.destinations = source, destinations
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.written: set[int] = set()
        self.refused: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.refused is None:
            self._check(getattr(func, "__name__", ""), args, kwargs)
        return func(*args, **kwargs)

    def _check(self, name: str, args: tuple, kwargs: dict) -> None:
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        in_place = name.endswith("_") and not name.startswith("__") or name in _IN_PLACE_DUNDERS
        if target is None or not in_place:
            return
        entry = self.destinations.get(_storage(target))
        if entry is None:
            return
        self.written.add(_storage(target))
        if name in ("fill_", "zero_", "__setitem__"):  # reset_lora: constants, not replayed (see the module)
            value = 0 if name == "zero_" else args[-1] if len(args) > 1 else kwargs.get("value")
            if not isinstance(value, (int, float, bool)):
                self.refused = f"{entry[0]}: written from a tensor by {name}"
            return
        if name == "copy_":
            source = args[1] if len(args) > 1 else kwargs.get("src")
            if isinstance(source, torch.Tensor) and _storage(source) == self.source:
                self.copies.append((target.detach(), source.detach()))
                return
            self.refused = f"{entry[0]}: copied from a tensor outside the live buffer"
            return
        self.refused = f"{entry[0]}: changed in place by {name}"


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _extent(tensor: torch.Tensor) -> int:
    """Bytes from a view's first element to just past its last."""
    if tensor.numel() == 0:
        return 0
    return tensor.element_size() * (1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True)))


def _checksums(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [torch.stack([t.float().sum(), t.float().norm()]) for t in tensors]


def _log(line: str) -> None:
    print(f"vlmreg worker: {line}", file=sys.stderr, flush=True)
