"""Selective recomputation under a memory budget (``trainer.memory_budget_gib``).

Before each micro-batch's forward, `RecomputePlanner.prepare` chooses which decoder layers and vision blocks keep their
activations for the backward pass and which recompute them (transformers' per-layer activation checkpointing, switched
layer by layer), so that the update's peak memory stays within the budget while recomputing as little as possible.

What each module keeps is measured, not assumed. The first micro-batch runs once through the model, eagerly, with a
saved-tensor hook that counts, per decoder layer and per vision block, the bytes the backward pass would keep (the
tensors themselves are dropped at once, so this needs no more memory than a forward without gradients), per row of its
input (a token for the layers, a patch row for the vision blocks). On a GPU, the first module of each class is then run
again as it runs in training (compiled, if the layers are), once keeping and once recomputing, on the input it got, and
the allocator's count after each call replaces the eager figures (a compiled layer keeps about a third less). Later
micro-batches scale the figures by their token count and by their pixel inputs.

The plan: everything held now (weights, gradients, optimizer state: the allocator's count on a GPU, the tensors' own
sizes on a CPU, plus the gradients not allocated yet), plus every module's activations, plus a reserve: the logprob
head's chunk of logits three times over (its logits, their gradient and the softmax when backward starts) and the
largest module's activations (one recomputed module exists at a time in backward). While that
exceeds the budget, the module that frees the most bytes per FLOP recomputed (its saved bytes per row over the
parameters a token's matmuls use: of a MoE layer's routed experts, only the ones a token is routed to, `active_params`)
is switched to recompute: vision blocks usually go first (they keep many wide activations for few
weights), then decoder layers. A module recomputing still keeps its input. A micro-batch that cannot fit even with every
module recomputing is warned about once, naming what to lower. On a GPU a budget above what the device can give the
process (its free memory and what PyTorch's allocator already reserved) is refused at once (`check_budget`): no plan
can keep it, and the step would run out of memory instead. The first update's plans leave out the optimizer state,
which its first step creates after the backward pass; from the second on it is held, so plans may change there.

Sharded (FSDP2, ``fully_shard`` per decoder layer and vision block, then the root: `vlmreg.train.distributed`). Every
rank plans for itself: its own micro-batches, its own plan. A recomputing layer runs its forward again inside its own
backward, while FSDP2 holds its weights gathered for that backward, so recomputation issues no collective of its own and
ranks may recompute different layers. The measuring passes do issue FSDP2's all-gathers (each sharded module's forward
gathers its weights), so every rank runs them at the same micro-batches: the first one, and the first that carries
pixels. FSDP2's own training forward already needs the ranks' i-th micro-batches to agree on carrying pixels (a vision
block's forward on one rank only is an all-gather the others never join; the trainer gives a rank without images a
stand-in image where another has some: `vlmreg.train.vision_ranks`), so both points fall on the same micro-batch on
every rank; the second pass on a GPU (each module class run again) is run by every rank for the same classes, after a
first unmeasured call that leaves FSDP2's forward prefetch (``shard_model(prefetch=N)``) pending, so the measured calls
see only what the module keeps. While a sharded module runs, its parameters are FSDP2's gathered tensors, which linear
layers save for backward: the counter leaves out the storages of the running module's current parameters (and the
root's), so what is measured is activations, as in one process. Held: on a GPU the allocator's count (this rank's
shards, their gradients, the optimizer state); on a CPU this rank's local shards. The reserve adds what FSDP2 holds only
for a while, at the parameters' global (unsharded) sizes: the root's parameters (gathered from the forward to the end of
backward) and the trainable ones' gradients (the head's exists from the start of backward), the largest sharded module's
weights 1 + max(prefetch, 1) times (the one being computed and those gathered ahead: FSDP2 gathers one ahead without
explicit prefetching, in forward and backward) and its trainable parameters' gradients twice (the unsharded gradients
and their copy into the reduce-scatter's input, before it sends this rank's shard home).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import attrs
import torch
from torch.utils.checkpoint import checkpoint

from vlmreg.modeling.logprobs import CHUNK_TOKENS
from vlmreg.modeling.sizes import active_params, held_bytes, is_sharded, local_part, unsharded_bytes
from vlmreg.resolution import ResolvedFamily
from vlmreg.sdk.errors import VlmregError

if TYPE_CHECKING:
    from transformers.modeling_layers import GradientCheckpointingLayer

__all__ = [
    "MemoryBudgetError",
    "ModuleProfile",
    "RecomputePlanner",
    "active_params",
    "check_budget",
    "held_bytes",
    "is_sharded",
    "unsharded_bytes",
]

GIB = 2**30


class MemoryBudgetError(VlmregError, ValueError):
    """``trainer.memory_budget_gib`` asks for more memory than the device can give."""


def check_budget(budget_bytes: int, device: torch.device) -> None:
    """Refuse a budget above what a CUDA ``device`` can give this process: its free memory plus what PyTorch's
    allocator has reserved already (memory held outside it, the CUDA context or another process, is not there to
    plan with). The allocator's fragmentation is not counted: a budget close to the room may still run out."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    room = free + torch.cuda.memory_reserved(device)
    if budget_bytes > room:
        raise MemoryBudgetError(
            f"trainer.memory_budget_gib = {budget_bytes / GIB:g} is more than {device} can give this process: "
            f"{room / GIB:.1f} GiB ({total / GIB:.1f} GiB on the device, {(total - room) / GIB:.1f} GiB of it held "
            f"outside PyTorch's allocator); set it to at most {int(room / GIB)}, and leave a few GiB for the "
            "allocator's fragmentation"
        )


@attrs.define
class ModuleProfile:
    """One decoder layer's or vision block's measured activations."""

    name: str  # "layers.3", "vision_blocks.0"
    module: GradientCheckpointingLayer  # its gradient_checkpointing flag is what the planner switches
    vision: bool
    params: int
    saved_per_row: float = 0.0  # bytes kept for backward per input row
    input_per_row: float = 0.0  # bytes of its input per row (what a recomputing module still keeps)
    rows_per_unit: float = 0.0  # rows per token (layers) or per pixel-input element (vision blocks)

    @property
    def freed_per_row(self) -> float:
        return max(self.saved_per_row - self.input_per_row, 0.0)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for value in (*args, kwargs.get("hidden_states")):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    return None


def _rows(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None or tensor.dim() == 0 else tensor.numel() // tensor.shape[-1]


def pixel_elements(inputs: dict) -> int:
    """What the vision tower's work scales with: the elements of the micro-batch's floating-point inputs (pixels)."""
    return sum(v.numel() for v in inputs.values() if isinstance(v, torch.Tensor) and v.is_floating_point())


def tokens_of(inputs: dict) -> int:
    ids = inputs.get("input_ids")
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else 0


def _storage_ptr(tensor: torch.Tensor) -> int:
    return local_part(tensor).untyped_storage().data_ptr()


class _Counter:
    """Saved-tensor hooks that count bytes per owner and keep nothing (the measuring forward never runs backward)."""

    def __init__(self, excluded: set[int]):
        self.excluded = excluded  # weights and buffers for the whole forward
        # per running module: its current parameters' storages (under FSDP2 the gathered ones, freed when it ends)
        self.scoped: list[set[int]] = []
        self.owner: list[str] = ["rest"]
        self.bytes: dict[str, int] = {}
        # storages counted, per owner, held until the owner's forward ends (so an address is not reused meanwhile)
        self.alive: dict[str, dict[int, torch.Tensor]] = {}

    def pack(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if (
            ptr not in self.excluded
            and not (self.scoped and ptr in self.scoped[-1])
            and tensor.device.type != "meta"
            and not any(ptr in held for held in self.alive.values())
        ):
            owner = self.owner[-1]
            self.alive.setdefault(owner, {})[ptr] = tensor
            self.bytes[owner] = self.bytes.get(owner, 0) + storage.nbytes()
        return None

    def release(self, owner: str) -> None:
        """``owner``'s forward ended: its tensors are let go (a forward that keeps everything would need the memory)."""
        self.alive.pop(owner, None)

    @staticmethod
    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("the measuring forward of the recompute planner has no backward pass")


class RecomputePlanner:
    """Switches each decoder layer and vision block between keeping and recomputing its activations, per micro-batch.

    ``budget_bytes``: the peak the update should stay within. ``held``: bytes held before a micro-batch's forward
    (default: the CUDA allocator's count on a GPU; on a CPU, `held_bytes` of the model and ``optimizer``).
    ``prefetch``: with a sharded model, the decoder layers FSDP2 gathers ahead (``shard_model``'s argument).
    Modules that are not transformers ``GradientCheckpointingLayer``s cannot be switched and always keep theirs.
    """

    def __init__(
        self,
        resolved: ResolvedFamily,
        budget_bytes: int,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        held: Callable[[], int] | None = None,
        prefetch: int = 0,
        log: Callable[[str], None] = print,
    ):
        self.resolved, self.budget, self.log = resolved, int(budget_bytes), log
        device = next(resolved.model.parameters()).device
        check_budget(self.budget, device)
        self.cuda = device.type == "cuda"
        # the allocator's count, for measuring a module as it runs (None: not measured so, only eagerly)
        self.allocated: Callable[[], int] | None = (
            (lambda: torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
        )
        if held is None:
            held = (
                (lambda: torch.cuda.memory_allocated(device))
                if device.type == "cuda"
                else (lambda: held_bytes(resolved.model, optimizer))
            )
        self.held = held
        self.modules: list[ModuleProfile] = []
        text = resolved.model.config.get_text_config() if hasattr(resolved.model, "config") else None
        for prefix, blocks, vision in (
            ("layers", resolved.layers, False),
            ("vision_blocks", resolved.vision_blocks, True),
        ):
            for index, module in enumerate(blocks or ()):
                self.modules.append(
                    ModuleProfile(f"{prefix}.{index}", module, vision, active_params(module, None if vision else text))
                )
        self.switchable = [m for m in self.modules if hasattr(type(m.module), "gradient_checkpointing")]
        self.sharded = is_sharded(resolved.model)  # FSDP2's DTensors
        self.sharded_reserve = self._sharded_reserve(prefetch) if self.sharded else 0
        fixed = [m for m in self.modules if m not in self.switchable]
        if fixed:  # a family's own layer classes: said once, not found out from an out-of-memory error
            kinds = sorted({type(m.module).__name__ for m in fixed})
            self.log(
                f"note: trainer.memory_budget_gib cannot have {len(fixed)} of {len(self.modules)} layers and vision "
                f"blocks recompute ({', '.join(kinds)}: not transformers GradientCheckpointingLayers); they always "
                "keep their activations"
            )
        for m in self.switchable:
            m.module._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
            m.module.gradient_checkpointing = False
        self.rest_per_token = 0.0
        # per module class, on a GPU: bytes kept at the rows measured
        self.device_measured: dict[str, dict[str, int]] = {}
        self.measured = False
        self.measured_vision = False
        self.last: dict[str, Any] = {}  # the last micro-batch's plan
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)  # the plans before it
        self._warned = False
        # what `end_step` last logged: what recomputed, and the predicted peak
        self._said: tuple[int, int] | None = None
        self._said_peak = 0
        # what the measured figures miss (allocator rounding, small buffers); grows if short
        self.margin = int(0.02 * self.budget)

    def _sharded_reserve(self, prefetch: int) -> int:
        """What FSDP2 holds for a while beyond this rank's shards, at the parameters' global sizes: the root's weights
        (gathered from the forward to the end of backward) and its trainable ones' gradients (the head's from the start
        of backward), the largest sharded module's weights ``1 + max(prefetch, 1)`` times (computed and gathered
        ahead), its gradients twice (unsharded, and copied into the reduce-scatter's input)."""
        model = self.resolved.model
        inner = {id(p) for m in self.modules for p in m.module.parameters()}
        root = [p for p in model.parameters() if id(p) not in inner]
        weights = max((unsharded_bytes(m.module.parameters()) for m in self.modules), default=0)
        grads = max(
            (unsharded_bytes(p for p in m.module.parameters() if p.requires_grad) for m in self.modules), default=0
        )
        root_bytes = unsharded_bytes(root) + unsharded_bytes(p for p in root if p.requires_grad)
        return root_bytes + (1 + max(prefetch, 1)) * weights + 2 * grads

    # -- measuring -------------------------------------------------------------------------------------------------
    def measure(self, forward: Callable[[], Any], inputs: dict) -> None:
        """Run ``forward`` (the model on ``inputs``) once, eagerly, counting what each module would keep."""
        model = self.resolved.model
        excluded = {_storage_ptr(p) for p in model.parameters()}
        excluded |= {_storage_ptr(b) for b in model.buffers()}
        counter = _Counter(excluded)
        rows: dict[str, int] = {}
        handles = []

        on_device = self.allocated is not None
        # each module class's first call, measured again below
        examples: dict[type, tuple[torch.nn.Module, tuple, dict]] = {}

        def enter(name: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            x = _first_tensor(args, kwargs)
            rows[name] = rows.get(name, 0) + _rows(x)
            if on_device and type(module) not in examples:
                examples[type(module)] = (module, args, kwargs)
            counter.owner.append(name)
            # its weights as they are now: under FSDP2 the gathered tensors (its hook ran first), saved by linear layers
            counter.scoped.append({_storage_ptr(p) for p in module.parameters()})
            if x is not None:  # the input: what a recomputing module still keeps
                counter.bytes[f"{name}:input"] = counter.bytes.get(f"{name}:input", 0) + x.numel() * x.element_size()

        def leave(name: str, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            counter.scoped.pop()
            counter.release(counter.owner.pop())

        def root_enter(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            # the root's weights as they are now (under FSDP2 gathered, and kept so until backward ends)
            counter.excluded |= {_storage_ptr(p) for p in module.parameters()}

        handles.append(model.register_forward_pre_hook(root_enter, with_kwargs=True))
        for m in self.modules:
            handles.append(m.module.register_forward_pre_hook(functools.partial(enter, m.name), with_kwargs=True))
            handles.append(m.module.register_forward_hook(functools.partial(leave, m.name), with_kwargs=True))
        flags = [(m.module, m.module.gradient_checkpointing) for m in self.switchable]
        try:
            for module, _ in flags:
                module.gradient_checkpointing = False
            with (
                torch.compiler.set_stance("force_eager"),
                torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack),
            ):
                forward()
        finally:
            for handle in handles:
                handle.remove()
            for module, flag in flags:
                module.gradient_checkpointing = flag
            counter.alive.clear()
            counter.scoped.clear()
        tokens, pixels = max(tokens_of(inputs), 1), pixel_elements(inputs)
        for m in self.modules:
            if m.vision and not pixels:
                continue
            n = rows.get(m.name, 0)
            if n:
                m.saved_per_row = counter.bytes.get(m.name, 0) / n
                m.input_per_row = counter.bytes.get(f"{m.name}:input", 0) / n
                m.rows_per_unit = n / (pixels if m.vision else tokens)
        self.rest_per_token = counter.bytes.get("rest", 0) / tokens
        for cls, (module, args, kwargs) in examples.items():  # on a GPU: what the module as it runs (compiled) keeps
            if self.sharded:  # unmeasured: the forward prefetch FSDP2 issues here stays pending, out of the counts
                self._allocated_by(module, args, kwargs, True)
            full, kept = (self._allocated_by(module, args, kwargs, recompute) for recompute in (False, True))
            x = _first_tensor(args, kwargs)
            n = _rows(x)
            if x is None or not n or full <= 0:
                continue
            given = x.numel() * x.element_size()  # the input, allocated before the call, kept in both cases
            self.device_measured[cls.__name__] = {
                "rows": n,
                "keeps_bytes": full + given,
                "recomputing_keeps_bytes": kept + given,
            }
            for m in self.modules:
                if type(m.module) is cls and m.saved_per_row:
                    m.saved_per_row, m.input_per_row = (full + given) / n, (max(kept, 0) + given) / n
        self.measured = True
        self.measured_vision = self.measured_vision or pixels > 0

    def _allocated_by(self, module: GradientCheckpointingLayer, args: tuple, kwargs: dict, recompute: bool) -> int:
        """Bytes the allocator holds after ``module`` ran on ``args`` with gradients, less its output (under FSDP2 its
        gathered weights are freed again when the call returns)."""
        allocated, cuda = cast(Callable[[], int], self.allocated), self.cuda

        def fresh(value: Any) -> Any:
            return (
                value.detach().requires_grad_(value.requires_grad)
                if isinstance(value, torch.Tensor) and value.is_floating_point()
                else value
            )

        args = tuple(fresh(a) for a in args)
        flag = module.gradient_checkpointing if hasattr(module, "gradient_checkpointing") else None
        if flag is None and recompute:
            return 0
        try:
            if flag is not None:
                module.gradient_checkpointing = recompute
            if cuda:
                torch.cuda.synchronize()
            before = allocated()
            with torch.enable_grad():
                out = module(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            after = allocated()
            outputs = (
                [out]
                if isinstance(out, torch.Tensor)
                else [o for o in (out if isinstance(out, (tuple, list)) else ()) if isinstance(o, torch.Tensor)]
            )
            given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            produced = {
                o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
                for o in outputs
                if o.untyped_storage().data_ptr() not in given
            }
            del out, outputs
            return after - before - sum(produced.values())
        finally:
            if flag is not None:
                module.gradient_checkpointing = flag

    # -- planning --------------------------------------------------------------------------------------------------
    def prepare(self, inputs: dict, forward: Callable[[], Any]) -> dict[str, Any]:
        """Choose what recomputes for this micro-batch (``forward`` runs it, for the first measurement)."""
        pixels = pixel_elements(inputs)
        model = self.resolved.model
        # before measuring: under FSDP2 that leaves the root's weights gathered (counted in the reserve)
        missing_grads = sum(  # of a sharded parameter, this rank's shard of its gradient
            local_part(p).numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None
        )
        held = self.held() + missing_grads
        if not self.measured or (pixels and not self.measured_vision):
            self.measure(forward, inputs)
        tokens = tokens_of(inputs)
        kept = {m.name: m.saved_per_row * m.rows_per_unit * (pixels if m.vision else tokens) for m in self.modules}
        activations = sum(kept.values()) + self.rest_per_token * tokens
        head = cast(torch.Tensor, self.resolved.lm_head.weight)
        reserve = (
            3 * min(tokens, CHUNK_TOKENS) * head.shape[0] * head.element_size()
            + max(kept.values(), default=0.0)
            + self.sharded_reserve
        )
        over = held + activations + reserve + self.margin - self.budget
        order = sorted(self.switchable, key=lambda m: m.params / m.freed_per_row if m.freed_per_row else float("inf"))
        chosen: set[str] = set()
        for m in order:
            if over <= 0:
                break
            freed = m.freed_per_row * m.rows_per_unit * (pixels if m.vision else tokens)
            if freed <= 0:
                continue
            chosen.add(m.name)
            over -= freed
        for m in self.switchable:
            m.module.gradient_checkpointing = m.name in chosen
        predicted = self.budget + over
        if over > 0 and not self._warned:
            self._warned = True
            self.log(
                f"warning: trainer.memory_budget_gib = {self.budget / GIB:g}: a micro-batch of {tokens:,} tokens needs "
                f"about {predicted / GIB:.1f} GiB even with every layer and vision block recomputing ({held / GIB:.1f} "
                "GiB of it weights, gradients and optimizer state); lower trainer.max_tokens_per_microbatch or raise "
                "the budget"
            )
        self.last = {
            "tokens": tokens,
            "recomputed_layers": sum(1 for m in self.switchable if m.name in chosen and not m.vision),
            "recomputed_vision_blocks": sum(1 for m in self.switchable if m.name in chosen and m.vision),
            "held_gib": round(held / GIB, 2),
            "activations_gib": round(activations / GIB, 2),
            "predicted_peak_gib": round(predicted / GIB, 2),
            "predicted_peak_bytes": int(predicted),
        }
        self.history.append(self.last)
        return self.last

    def begin_step(self) -> None:
        """An update starts: the plans from here on are its own (`end_step` sums them up)."""
        self.history.clear()

    def end_step(self, peak_bytes: int | None = None) -> dict[str, Any]:
        """The update's plans summed up (the largest micro-batch's), logged when what recomputes changes or the
        predicted peak moves by a GiB or more (the second update's plans hold the optimizer state the first one's step
        created); with the peak the allocator saw (``peak_bytes``), a prediction that fell short widens the margin kept
        from then on by the shortfall."""
        plans = list(self.history)
        summary = {
            "tokens": max((p["tokens"] for p in plans), default=0),
            "recomputed_layers": max((p["recomputed_layers"] for p in plans), default=0),
            "recomputed_vision_blocks": max((p["recomputed_vision_blocks"] for p in plans), default=0),
            "predicted_peak_bytes": max((p["predicted_peak_bytes"] for p in plans), default=0),
        }
        if peak_bytes is not None and plans and peak_bytes > summary["predicted_peak_bytes"]:
            self.margin += peak_bytes - summary["predicted_peak_bytes"]
        summary["margin_gib"] = round(self.margin / GIB, 2)
        said = (summary["recomputed_layers"], summary["recomputed_vision_blocks"])
        moved = abs(summary["predicted_peak_bytes"] - self._said_peak) >= GIB
        if plans and (said != self._said or moved):
            self._said, self._said_peak = said, summary["predicted_peak_bytes"]
            self.log(self.describe(summary))
        return summary

    def describe(self, summary: dict[str, Any]) -> str:
        """One line for the log: what recomputed in the largest micro-batch of an update (`end_step`'s summary)."""
        layers = sum(1 for m in self.modules if not m.vision)
        blocks = sum(1 for m in self.modules if m.vision)
        return (
            f"memory budget {self.budget / GIB:g} GiB: at up to {summary['tokens']:,} tokens a micro-batch, "
            f"{summary['recomputed_layers']} of {layers} layers and {summary['recomputed_vision_blocks']} of {blocks} "
            f"vision blocks recompute their activations (predicted peak {summary['predicted_peak_bytes'] / GIB:.1f} "
            f"GiB, margin {self.margin / GIB:.1f} GiB)"
        )
