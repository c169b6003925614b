"""`CopyPlan`: an inference engine's weight loader, recorded once as the copies it makes, then replayed as one
grouped copy.

An engine such as vLLM loads each sync through its model's ``load_weights``: per tensor, Python that looks up the
parameter, picks a shard (``q``/``k``/``v`` into a fused ``qkv_proj``, a tensor-parallel slice) and copies. On one GPU
that Python, not the bytes, is most of a sync. When the tensors of a sync live where they lived the last time (CUDA
IPC views of the trainer's parameters do), every sync makes the same copies between the same memory; so the loader
runs once under a `torch.overrides.TorchFunctionMode` that records each ``copy_`` from a view of an incoming tensor
into a view of a parameter (and each constant ``fill_``, such as an embedding's padding rows), and later syncs replay
those (destination, source) view pairs with ``torch._foreach_copy_``, a few kernel launches for the whole model.

Recording is strict. The plan is refused (and the loader keeps running every sync) when the loader does anything a
replay would miss: a copy into a parameter from a tensor it computed (a cast, a ``contiguous()``, arithmetic), any
other in-place change of a parameter, a parameter replaced, an incoming tensor never copied, or a parameter whose
values changed with no recorded copy into it (checked by a checksum over every parameter and buffer). Whether a
later sync may replay is decided by a key: the incoming tensors' names, memory addresses, offsets, shapes, strides and
dtypes, and the model's parameter addresses; any difference records afresh.

Pushed plans: when the process that sends the tensors shares the engine's GPU (CUDA IPC), the engine can hand its
plan over (`CopyPlan.export`: each copy as offsets into the sender's own tensors and into the engine's weight
allocations, those shared by CUDA IPC), and the sender replays it itself (`PushedPlan`), writing straight into the
engine's weights: a sync is then the copies alone, with no request to the engine. Only while the engine runs no
forward pass (the trainer's syncs exclude rollouts), and only for the layout the plan was recorded for.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from vlmreg.broadcast import copy_kernel
from vlmreg.broadcast.buckets import _dtype, dtype_name
from vlmreg.broadcast.errors import BroadcastError

__all__ = [
    "EXPORT_VERSION",
    "CopyPlan",
    "GroupedCopies",
    "PlanRefused",
    "PlannedLoads",
    "PushedPlan",
    "incoming_key",
    "model_key",
]

#: The version of `CopyPlan.export`'s description.
EXPORT_VERSION = 1

Pairs = Sequence[tuple[str, torch.Tensor]]


def _grouped(copies: Sequence[tuple[torch.Tensor, torch.Tensor]], *, kernel: bool = True) -> tuple[Any, list]:
    """How to replay ``copies``: the plain byte ranges as one chunked-copy kernel (on a GPU with Triton,
    `vlmreg.broadcast.copy_kernel`), the rest grouped by (device, dtypes) into ``_foreach_copy_`` calls."""
    kernel = kernel and copy_kernel.available()
    ranges: list[tuple[torch.Tensor, torch.Tensor]] = []
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src in copies:
        if kernel and copy_kernel.eligible(dst, src):
            ranges.append((dst, src))
        else:
            dsts, srcs = groups.setdefault((dst.device, dst.dtype, src.dtype), ([], []))
            dsts.append(dst)
            srcs.append(src)
    return (copy_kernel.ChunkedCopies(ranges) if ranges else None), list(groups.values())


def _replay(fills: Sequence[tuple[torch.Tensor, Any]], chunked: Any, groups: Sequence[tuple[list, list]]) -> None:
    with torch.no_grad():
        for dst, value in fills:
            dst.fill_(value)
        if chunked is not None:
            chunked.run()
        for dsts, srcs in groups:
            torch._foreach_copy_(dsts, srcs)


class GroupedCopies:
    """(destination, source) view pairs made again together, as a plan replays its copies (`_grouped`)."""

    def __init__(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.copies = list(copies)
        self.chunked, self.groups = _grouped(self.copies)

    def run(self) -> None:
        """Queue every copy on the current stream."""
        _replay((), self.chunked, self.groups)


class PlanRefused(Exception):
    """The loader did something a recorded plan could not replay; the message says what."""


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def incoming_key(pairs: Pairs) -> tuple:
    """What must be equal between two syncs for one plan to serve both: every tensor's name and memory layout."""
    return tuple(
        (name, _storage(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device) for name, t in pairs
    )


def model_key(model: nn.Module) -> tuple:
    """The addresses of the model's parameters and buffers: a plan's destinations are views of exactly these."""
    return tuple((name, t.data_ptr()) for name, t in (*model.named_parameters(), *model.named_buffers()))


def _checksums(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per tensor: its sum, its norm and the sum of every 7th value, accumulated in float32 without a converted copy
    (a changed value shows in the first two, a permutation of values in the third)."""
    out = {}
    with torch.no_grad():
        for name, t in tensors.items():
            if t.numel() == 0 or not t.is_floating_point():
                continue
            flat = t.detach().reshape(-1)
            out[name] = torch.stack(
                [
                    torch.sum(flat, dtype=torch.float32),
                    torch.linalg.vector_norm(flat, dtype=torch.float32),
                    torch.sum(flat[::7], dtype=torch.float32),
                ]
            )
    return out


class _Recorder(TorchFunctionMode):
    """Sees every torch call the loader makes from Python; keeps the copies from incoming memory into parameter
    memory."""

    def __init__(self, incoming: set[int], destinations: dict[int, str]) -> None:
        super().__init__()
        self.incoming, self.destinations = incoming, destinations
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fills: list[tuple[torch.Tensor, int | float | bool]] = []
        self.sources_used: set[int] = set()
        self.refused: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.refused is None:
            self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func: Any, args: tuple, kwargs: dict) -> None:
        name = getattr(func, "__name__", "")
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is None:
            return
        in_place = (name.endswith("_") and not name.startswith("__")) or name in (
            "__setitem__",
            "__iadd__",
            "__isub__",
            "__imul__",
            "__itruediv__",
        )
        if not in_place:
            return
        owner = self.destinations.get(_storage(target))
        if owner is None:
            return
        if name in ("fill_", "zero_"):  # a constant into a region (an embedding's padding rows): replayed as it is
            value = 0 if name == "zero_" else (args[1] if len(args) > 1 else kwargs.get("value"))
            if isinstance(value, (int, float, bool)):
                if target.numel():
                    self.fills.append((target.detach(), value))
                return
            self.refused = f"{owner}: filled from a tensor, which a replay could not repeat"
            return
        if name == "copy_":
            # the keyword's name varies by torch version
            source = args[1] if len(args) > 1 else kwargs.get("src", kwargs.get("other"))
            if isinstance(source, torch.Tensor) and _storage(source) in self.incoming:
                self.copies.append((target.detach(), source.detach()))
                self.sources_used.add(_storage(source))
                return
            self.refused = f"{owner}: copied from a tensor the loader computed, not from an incoming one"
            return
        self.refused = f"{owner}: changed in place by {name}, which a replay of copies would miss"


class CopyPlan:
    """The copies one loader call made, replayable for tensors at the same addresses."""

    def __init__(
        self,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        key: tuple,
        model_key: tuple,
        fills: Sequence[tuple[torch.Tensor, int | float | bool]] = (),
    ) -> None:
        self.copies, self.fills = copies, list(fills)
        self.key, self.model_key = key, model_key
        self.chunked, self.groups = _grouped(copies)

    @property
    def bytes(self) -> int:
        return sum(dst.numel() * dst.element_size() for dst, _ in self.copies)

    def export(self, incoming: Pairs, share: Callable[[torch.Tensor], dict[str, Any]]) -> dict[str, Any]:
        """This plan as JSON for the process that holds ``incoming`` (the pairs it was recorded from, in the order the
        sender sent them): each copy's source as (incoming index, byte offset into that tensor's allocation, shape,
        stride, dtype), its destination the same way into the engine's allocations, each of those passed once to
        ``share`` (a uint8 tensor over the whole allocation; CUDA IPC's `vlmreg.broadcast.ipc.describe` on a GPU)."""
        sources: dict[int, int] = {}
        for index, (_, tensor) in enumerate(incoming):
            sources.setdefault(_storage(tensor), index)
        destinations: dict[int, int] = {}
        shared: list[dict[str, Any]] = []

        def where(view: torch.Tensor, index: int) -> list[Any]:
            return [
                index,
                view.data_ptr() - _storage(view),
                list(view.shape),
                list(view.stride()),
                dtype_name(view.dtype),
            ]

        def destination(view: torch.Tensor) -> list[Any]:
            ptr = _storage(view)
            if ptr not in destinations:
                storage = view.untyped_storage()
                destinations[ptr] = len(shared)
                shared.append(
                    share(
                        torch.empty(0, dtype=torch.uint8, device=view.device).set_(
                            storage, 0, (storage.nbytes(),), (1,)
                        )
                    )
                )
            return where(view, destinations[ptr])

        copies = []
        for dst, src in self.copies:
            if dst.numel() == 0:
                continue
            source_index = sources.get(_storage(src))
            if source_index is None:
                raise PlanRefused("a recorded copy reads memory that is not among the incoming tensors")
            copies.append({"dst": destination(dst), "src": where(src, source_index)})
        fills = [{"dst": destination(dst), "value": value} for dst, value in self.fills if dst.numel()]
        return {
            "version": EXPORT_VERSION,
            "destinations": shared,
            "copies": copies,
            "fills": fills,
            "bytes": self.bytes,
        }

    @classmethod
    def record(cls, model: nn.Module, load: Callable[[list[tuple[str, torch.Tensor]]], Any], pairs: Pairs) -> CopyPlan:
        """Run ``load(pairs)`` once (it really loads them) and return its plan, or raise `PlanRefused` after loading."""
        pairs = list(pairs)
        tensors: dict[str, torch.Tensor] = {f"parameter {n}": p for n, p in model.named_parameters()}
        tensors.update({f"buffer {n}": b for n, b in model.named_buffers()})
        destinations = {_storage(t): name.split(" ", 1)[1] for name, t in tensors.items()}
        incoming = {_storage(t) for _, t in pairs}
        overlap = incoming & set(destinations)
        if overlap:
            raise PlanRefused("an incoming tensor shares memory with the model's own weights")
        before_key = model_key(model)
        before = _checksums(tensors)
        recorder = _Recorder(incoming, destinations)
        with recorder:
            load(pairs)
        if recorder.refused:
            raise PlanRefused(recorder.refused)
        if model_key(model) != before_key:
            raise PlanRefused("the loader replaced parameters (their memory moved), so recorded views would be stale")
        unused = [name for name, t in pairs if _storage(t) not in recorder.sources_used]
        if unused:
            raise PlanRefused(
                f"{len(unused)} incoming tensor(s) were never copied by a recorded copy_ (first: {unused[0]})"
            )
        written = {_storage(dst) for dst, _ in [*recorder.copies, *recorder.fills]}
        after = _checksums(tensors)
        silent = [
            name
            for name, value in after.items()
            if not torch.equal(value, before[name]) and _storage(tensors[name]) not in written
        ]
        if silent:
            raise PlanRefused(f"{silent[0]} changed with no recorded copy into it")
        return cls(recorder.copies, incoming_key(pairs), before_key, recorder.fills)

    def replay(self) -> None:
        """Make every recorded copy (and constant fill) again, from the incoming memory as it is now."""
        _replay(self.fills, self.chunked, self.groups)


class PlannedLoads:
    """A loader used through plans: the first sync of a layout loads plainly, the second records, later ones replay.
    A refused layout keeps the loader (its reason in ``refused``); ``last`` says how the last sync was loaded:
    ``"loaded"``, ``"recorded"`` or ``"replayed"``."""

    #: Layouts remembered (seen, planned, refused), newest kept: syncs whose tensors move every time (merged LoRA
    #: weights, say) must not pile up keys for the whole run.
    REMEMBERED = 8

    def __init__(self) -> None:
        self.seen: OrderedDict[tuple, None] = OrderedDict()
        self.plans: OrderedDict[tuple, CopyPlan] = OrderedDict()
        self.refused: OrderedDict[tuple, str] = OrderedDict()
        self.last = ""

    def plan_for(self, model: nn.Module, pairs: Pairs) -> CopyPlan | None:
        """The plan `load` would replay for ``pairs`` now (``None``: it would load or record); a caller that replays it
        itself (bucket by bucket) sets ``last = "replayed"``."""
        plan = self.plans.get(incoming_key(pairs))
        return plan if plan is not None and plan.model_key == model_key(model) else None

    def load(
        self,
        model: nn.Module,
        load: Callable[[list[tuple[str, torch.Tensor]]], Any],
        pairs: Iterable[tuple[str, torch.Tensor]],
    ) -> str:
        pairs = list(pairs)
        key = incoming_key(pairs)
        plan = self.plans.get(key)
        if plan is not None and plan.model_key == model_key(model):
            plan.replay()
            self.last = "replayed"
        elif plan is not None:  # the parameters moved since the plan was recorded: they may move every sync
            del self.plans[key]
            self.refused[key] = "the model's parameters moved between syncs"
            load(pairs)
            self.last = "loaded"
        elif key in self.seen and key not in self.refused:
            try:
                self.plans[key] = CopyPlan.record(model, load, pairs)
                self.last = "recorded"
            except PlanRefused as exc:
                self.refused[key] = str(exc)
                self.last = "loaded"
        else:
            self.seen[key] = None
            load(pairs)
            self.last = "loaded"
        for remembered in (self.seen, self.plans, self.refused):
            while len(remembered) > self.REMEMBERED:
                remembered.popitem(last=False)
        return self.last


def _view(storage: torch.UntypedStorage, device: torch.device, where: Sequence[Any], what: str) -> torch.Tensor:
    """The view ``where`` = [index, byte offset, shape, stride, dtype] describes, checked to lie inside ``storage``."""
    try:
        _, offset, shape, stride, dtype_name = where
        dtype = _dtype(str(dtype_name))
        shape, stride, offset = [int(n) for n in shape], [int(n) for n in stride], int(offset)
    except (TypeError, ValueError, BroadcastError) as exc:
        raise PlanRefused(f"pushed plan: {what} is malformed ({exc})") from None
    item = torch.empty((), dtype=dtype).element_size()
    if len(shape) != len(stride) or offset < 0 or offset % item or min(shape + stride, default=0) < 0:
        raise PlanRefused(f"pushed plan: {what} has an impossible layout")
    extent = 0 if 0 in shape else item * (1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)))
    if offset + extent > storage.nbytes():
        raise PlanRefused(
            f"pushed plan: {what} ends at byte {offset + extent}, past its allocation ({storage.nbytes()} bytes)"
        )
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset // item, shape, stride)


class PushedPlan:
    """A plan an engine exported (`CopyPlan.export`), replayed by the sender into the engine's own memory.

    ``sources``: the tensors of the sync the plan was recorded from, in the order they were sent (the same memory
    the engine read); ``open``: maps one shared destination allocation (an entry of the export's
    ``"destinations"``) to a uint8 tensor over it (`vlmreg.broadcast.ipc.open_tensor` on a GPU). Every view is
    checked to lie inside its allocation. ``layout``: what the caller keys the plan by (the sync it serves).
    """

    def __init__(
        self,
        exported: dict[str, Any],
        sources: Sequence[torch.Tensor],
        open: Callable[[dict[str, Any]], torch.Tensor],
        *,
        layout: Any = None,
    ) -> None:
        if not isinstance(exported, dict) or exported.get("version") != EXPORT_VERSION:
            raise PlanRefused(f"pushed plan: expected version {EXPORT_VERSION}")
        self.layout = layout
        # kept: the engine's memory stays mapped
        self.bases = [open(entry) for entry in exported.get("destinations", [])]
        self.sources = list(sources)

        def view(among: list[torch.Tensor], where: Sequence[Any], what: str, kind: str) -> torch.Tensor:
            index = where[0] if isinstance(where, (list, tuple)) and where else None
            if not isinstance(index, int) or not 0 <= index < len(among):
                raise PlanRefused(f"pushed plan: {what} names no {kind}")
            return _view(among[index].untyped_storage(), among[index].device, where, what)

        def destination(where: Sequence[Any], what: str) -> torch.Tensor:
            return view(self.bases, where, what, "shared allocation")

        def source(where: Sequence[Any], what: str) -> torch.Tensor:
            return view(self.sources, where, what, "sent tensor")

        copies = []
        for number, entry in enumerate(exported.get("copies", [])):
            dst, src = (
                destination(entry.get("dst"), f"copy {number}'s destination"),
                source(entry.get("src"), f"copy {number}'s source"),
            )
            try:
                torch.broadcast_shapes(src.shape, dst.shape)
            except RuntimeError:
                raise PlanRefused(
                    f"pushed plan: copy {number} has shapes {tuple(src.shape)} -> {tuple(dst.shape)}"
                ) from None
            copies.append((dst, src))
        self.fills = []
        for number, entry in enumerate(exported.get("fills", [])):
            value = entry.get("value")
            if not isinstance(value, (int, float, bool)):
                raise PlanRefused(f"pushed plan: fill {number} has no constant value")
            self.fills.append((destination(entry.get("dst"), f"fill {number}'s destination"), value))
        self.copies = copies
        self.bytes = sum(dst.numel() * dst.element_size() for dst, _ in copies)
        self.regroup()

    def regroup(self, *, kernel: bool = True) -> None:
        """Plain byte ranges through the chunked-copy kernel where it runs (``kernel=False``: every copy in
        ``_foreach_copy_`` groups, as a worker without Triton would)."""
        self.chunked, self.groups = _grouped(self.copies, kernel=kernel)

    def replay(self) -> None:
        """Queue every copy (and fill) on the current stream; the caller synchronizes before the engine reads."""
        _replay(self.fills, self.chunked, self.groups)
