"""The broadcast benchmark: one sync of the language model, timed against one flat broadcast of the same bytes.

`run_bench` spawns the sender (rank 0) and the receivers as separate processes. Each builds the family's model of
the named size (``layers``: only its first N decoder layers; random init, each rank its own seed; bf16 on its own
GPU for nccl, fp32 on CPU for gloo) with the vision tower frozen, so the per-step sync is the language model. The
raw broadcasts run first, their buffer freed before the first sync, so no rank holds a third copy of the weights.
After a first full sync, every timed iteration starts at a barrier and ends when the rank's device is idle; an
iteration's time is the slowest rank's, and ``seconds`` / ``raw_seconds`` are medians. Then the receivers apply what
they got and check, bitwise, the last sync and their whole model against the sender's tensors sent one by one (a
path without buckets).

``shards`` > 1: the sender is an FSDP2 trainer of that many processes (``fully_shard`` per decoder layer and vision
block, then the root, as the trainer's ``shard_model``; GPUs ``0..shards-1``, receivers on the next ones or from
``receiver_gpu`` on, which on a machine of two GPUs puts the receiver beside trainer rank 1), built
alike (one seed), rank 0 sending and the others taking part in every gather, as `vlmreg.inference.server_link` has
them. The reference the receivers check against is then rank 0's copy of the plan's tensors taken before sharding
(on the CPU), so a gather or a bucket in the wrong place cannot agree with itself.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlmreg.broadcast.buckets import dtype_name
from vlmreg.broadcast.group import broadcast as _broadcast
from vlmreg.broadcast.plan import WeightPlan, apply_weights
from vlmreg.broadcast.tensor_stream import AHEAD_BYTES
from vlmreg.broadcast.transport import BACKENDS, Receiver, Sender
from vlmreg.loading.build import build_model, shallower
from vlmreg.resolution import resolve
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_registry

__all__ = ["NO_MULTICAST_ENV", "BenchOptions", "run_bench"]

#: Kept in the benchmark processes' environment: NVLink multicast (NVLS) stays off on the lent GPU machines.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@attrs.frozen(kw_only=True)
class BenchOptions:
    family: str
    size: str = "tiny"
    layers: int | None = None
    backend: str = "gloo"
    bucket_mb: int = 512
    ring_depth: int = 2
    gather_ahead_mb: int = AHEAD_BYTES // 2**20
    iters: int = 10
    warmup: int = 2
    receivers: int = 1
    shards: int = 1
    receiver_gpu: int | None = None  # nccl: the first receiver's GPU (default: the one after the trainer's last)
    checksum: bool = False
    timeout_s: float = 120.0
    profile: bool = False  # one more sync after the timed ones, under torch's profiler on the sending rank


def _check(options: BenchOptions) -> None:
    descriptor = get_registry().get(options.family)
    sizes = ["tiny", *descriptor.shapes]
    if options.size not in sizes:
        raise VlmregError(f"family {options.family} has no size {options.size!r}; sizes: {', '.join(sizes)}")
    if options.backend not in BACKENDS:
        raise VlmregError(f"--backend must be one of {', '.join(BACKENDS)} (got {options.backend!r})")
    if options.gather_ahead_mb < 0:
        raise VlmregError("--gather-ahead-mb must be >= 0")
    if min(options.receivers, options.shards, options.iters, options.bucket_mb, options.ring_depth) < 1:
        raise VlmregError("--receivers, --shards, --iters, --bucket-mb and --ring-depth must be >= 1")
    if options.backend == "nccl":
        gpus, first = torch.cuda.device_count(), _receiver_gpu(options)
        if first < 1:
            raise VlmregError(f"--receiver-gpu must be >= 1: GPU 0 is the sender's (got {first})")
        if gpus < first + options.receivers or gpus < options.shards:
            raise VlmregError(
                f"--backend nccl needs {max(first + options.receivers, options.shards)} GPUs (the trainer's "
                f"{options.shards}, receivers from GPU {first}); torch sees {gpus}"
            )
    elif options.receiver_gpu is not None:
        raise VlmregError("--receiver-gpu is for --backend nccl")


def _receiver_gpu(options: BenchOptions) -> int:
    return options.shards if options.receiver_gpu is None else options.receiver_gpu


def _gpu(options: BenchOptions, rank: int) -> int:
    """A process's GPU: a trainer rank's own, a receiver's from ``receiver_gpu`` on (which may be a trainer rank's
    other than rank 0's: the weight group and the trainer's group are separate NCCL communicators)."""
    return rank if rank < options.shards else _receiver_gpu(options) + rank - options.shards


def run_bench(options: BenchOptions) -> dict[str, Any]:
    """Run the benchmark in ``receivers + 1`` spawned processes and return its JSON-ready result."""

    _check(options)
    os.environ.update(NO_MULTICAST_ENV)
    with tempfile.TemporaryDirectory(prefix="vlmreg-bench-") as tmp:
        try:
            mp.spawn(_worker, args=(options, tmp), nprocs=options.receivers + options.shards, join=True)
        except mp.ProcessRaisedException as exc:
            lines = [line for line in str(exc).strip().splitlines() if line.strip()]
            raise VlmregError(f"benchmark process failed: {lines[-1] if lines else exc}") from None
        except mp.ProcessExitedException as exc:
            raise VlmregError(f"benchmark process died: {exc}") from None
        weight_ranks = [0, *range(options.shards, options.shards + options.receivers)]  # the trainer's others send none
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in weight_ranks]
    head = ranks[0]
    seconds = statistics.median(max(times) for times in zip(*(r["sync"] for r in ranks), strict=True))
    raw = statistics.median(max(times) for times in zip(*(r["raw"] for r in ranks), strict=True))
    return {
        "family": options.family,
        "size": options.size,
        "layers": options.layers,
        "backend": options.backend,
        "device": head["device"],
        "receivers": options.receivers,
        "shards": options.shards,
        "dtype": head["dtype"],
        "bytes": head["bytes"],
        "tensors": head["tensors"],
        "buckets": head["buckets"],
        "bucket_mb": options.bucket_mb,
        "ring_depth": options.ring_depth,
        "gather_ahead_mb": options.gather_ahead_mb,
        "checksum": options.checksum,
        "iters": options.iters,
        "seconds": seconds,
        "raw_seconds": raw,
        "ratio": seconds / raw if raw > 0 else None,
        "gb_per_s": head["bytes"] / seconds / 1e9 if seconds > 0 else None,
        "verified": all(r["verified"] for r in ranks[1:]),
        **{k: head[k] for k in ("sender_before_gib", "sender_peak_gib", "profile") if k in head},
        "torch": torch.__version__,
    }


class _Memory:
    """The sending rank's GPU memory over its syncs: what it held before them, and the most it held during them
    (gathered tensors and ring buffers; on an FSDP2 trainer rank its shards before)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.before, self.peak = device, 0, 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.before = torch.cuda.memory_allocated(device)

    def stop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)

    def figures(self) -> dict[str, float]:
        if self.device.type != "cuda":
            return {}
        return {"sender_before_gib": self.before / 2**30, "sender_peak_gib": self.peak / 2**30}


#: What the sending rank's GPU does in a sync, by kernel name: NCCL's broadcast (the buckets leaving), its send/receive
#: (a gather is sends and receives to rank 0), copies (packing), anything else.
_KINDS = (
    ("broadcast", ("Broadcast",)),
    ("gather", ("SendRecv", "Gather", "Recv", "Send")),
    ("copy", ("Memcpy", "copy")),
)


def _profiled(group: Any, device: torch.device, action: Any) -> dict[str, Any]:
    """One more sync under torch's profiler: how long the GPU spent on each kind of kernel (`_KINDS`, the union of each
    kind's intervals) and how much of the broadcasts' time a gather ran beside them, to tell overlap from turns."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415  (only for --profile)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        seconds = _timed(group, device, action)
    spans: dict[str, list[tuple[float, float]]] = {kind: [] for kind, _ in _KINDS}
    spans["other"] = []
    by_name: dict[str, list[float]] = {}  # kernel name -> [count, seconds]
    for event in prof.events():
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        if getattr(event, "is_user_annotation", False):  # "nccl:broadcast" and the like: a span over kernels, not one
            continue
        kind = next((k for k, marks in _KINDS if any(m in event.name for m in marks)), "other")
        start, end = event.time_range.start, event.time_range.end
        spans[kind].append((start, end))
        entry = by_name.setdefault(f"{kind}: {event.name[:120]}", [0, 0.0])
        entry[0], entry[1] = entry[0] + 1, entry[1] + (end - start) / 1e6
    busy = {kind: _union(s) for kind, s in spans.items()}
    beside = _union(_intersect(_merged(spans["broadcast"]), _merged(spans["gather"])))
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:12]
    return {
        "profile": {
            "seconds": seconds,
            **{f"{kind}_s": us / 1e6 for kind, us in busy.items()},
            "broadcast_beside_gather_s": beside / 1e6,
            "kernels": {kind: len(s) for kind, s in spans.items()},
            "top_kernels": [{"name": name, "count": int(n), "seconds": t} for name, (n, t) in top],
        }
    }


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _union(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in _merged(spans))


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Where two sorted lists of disjoint intervals overlap."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _settle(group: Any, device: torch.device) -> None:
    """Barrier: every rank's queued work done, then all ranks leave together."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    group.allreduce([torch.zeros(1, device=device)]).wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(group: Any, device: torch.device, action: Any) -> float:
    _settle(group, device)
    started = time.perf_counter()
    action()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _raw(group: Any, device: torch.device, nbytes: int, rounds: int) -> list[float]:
    """The reference: one flat broadcast of the sync's bytes, ``rounds`` times. It runs before the first sync and its
    buffer is freed after, so no rank holds it beside the receiver's staging buffers (a 30B model's 60 GB each)."""
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = [_timed(group, device, lambda buffer=flat: _broadcast(group, buffer).wait()) for _ in range(rounds)]
    del flat
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times


def _build(options: BenchOptions, rank: int) -> tuple[Any, torch.device]:
    descriptor = get_registry().get(options.family)
    device = torch.device("cuda", _gpu(options, rank)) if options.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(1000 + (0 if rank < options.shards else rank))  # a sharded trainer's ranks build one model
    shape = shallower(descriptor.config_for_size(options.size), options.layers, what=f"{options.family} {options.size}")
    model = build_model(shape, descriptor, device=device, dtype=dtype)
    resolved = resolve(model, family=descriptor)
    for module in (resolved.vision_encoder, *resolved.connectors.values()):
        module.requires_grad_(False)
    for parameter in resolved.connector_parameters.values():
        parameter.requires_grad_(False)
    return resolved, device


def _shard(options: BenchOptions, rank: int, tmp: str, resolved: Any, device: torch.device) -> dict[str, Any] | None:
    """Shard the trainer's model across its ``shards`` processes (a process group of their own); rank 0 first keeps
    the plan's tensors on the CPU (the receivers' reference). ``None`` (one process) or rank 0's reference."""
    if options.shards == 1:
        return None
    # deferred: only a sharded benchmark needs them (start-up cost)
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    reference = None
    if rank == 0:
        plan = WeightPlan.from_resolved(resolved, include_frozen_vision=True)
        reference = {n: t.detach().cpu() for n, t in plan.tensors()}
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp}/trainer", rank=rank, world_size=options.shards)
    mesh = init_device_mesh(device.type, (options.shards,))
    for module in (*resolved.layers, *(resolved.vision_blocks or ())):  # as the trainer shards (`shard_model`)
        fully_shard(module, mesh=mesh)
    fully_shard(resolved.model, mesh=mesh)
    return reference


def _trainer_rank(options: BenchOptions, resolved: Any) -> None:
    """A sharded trainer's rank other than 0: takes part in gathering every tensor of every sync rank 0 sends."""
    for kind in ["full"] + ["step"] * (options.warmup + options.iters + options.profile):
        for _ in WeightPlan.from_resolved(resolved, include_frozen_vision=kind == "full").tensors():
            pass
    dist.barrier()
    dist.destroy_process_group()


def _worker(rank: int, options: BenchOptions, tmp: str) -> None:
    os.environ.update(NO_MULTICAST_ENV)
    resolved, device = _build(options, rank)
    port_file = Path(tmp) / "port"
    rounds = options.warmup + options.iters
    unsharded = _shard(options, rank, tmp, resolved, device) if rank < options.shards else None
    if 0 < rank < options.shards:
        _trainer_rank(options, resolved)
        return
    if rank == 0:
        sender = Sender(
            resolved,
            num_receivers=options.receivers,
            backend=options.backend,
            device=device,
            bucket_mb=options.bucket_mb,
            ring_depth=options.ring_depth,
            gather_ahead_mb=options.gather_ahead_mb,
            timeout_s=options.timeout_s,
            checksum=options.checksum,
        )
        (Path(tmp) / "port.tmp").write_text(f"{sender.port} {sender.token}")
        os.replace(Path(tmp) / "port.tmp", port_file)
        sender.connect()
        group = sender.process_group
        layout = sender.layouts[-1]
        raw = _raw(group, device, layout.payload_bytes, rounds)
        memory = _Memory(device)
        sender.send(0)
        sync = [_timed(group, device, lambda i=i: sender.send(i)) for i in range(1, rounds + 1)]
        memory.stop()
        profiled = _profiled(group, device, lambda: sender.send(rounds + 1)) if options.profile else {}
        reference = unsharded or dict(sender.plans["full"].tensors())
        for slot in sender.layouts[0].tensors:
            _broadcast(group, reference[slot.name].detach().to(device).contiguous()).wait()
        _settle(group, device)
        sender.close()
        if unsharded is not None:
            dist.barrier()
            dist.destroy_process_group()
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        result = {
            "device": name,
            "dtype": dtype_name(resolved.model.dtype),
            "bytes": layout.payload_bytes,
            "tensors": len(layout.tensors),
            "buckets": len(layout.buckets),
            "verified": True,
            **memory.figures(),
            **profiled,
        }
    else:
        deadline = time.monotonic() + options.timeout_s
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise VlmregError(f"rank {rank}: the sender did not start within {options.timeout_s} s")
            time.sleep(0.05)
        port, token = port_file.read_text().split()
        receiver = Receiver(
            resolved,
            host="127.0.0.1",
            port=int(port),
            rank=rank - options.shards + 1,
            backend=options.backend,
            device=device,
            timeout_s=options.timeout_s,
            token=token,
        )
        group = receiver.process_group
        raw = _raw(group, device, receiver.layouts[-1].payload_bytes, rounds)
        apply_weights(resolved, receiver.receive())
        received: dict[str, torch.Tensor] = {}

        def receive() -> None:
            received.clear()
            received.update(receiver.receive())

        sync = [_timed(group, device, receive) for _ in range(rounds)]
        if options.profile:
            _timed(group, device, receive)  # the sender's profiled sync
        apply_weights(resolved, received)
        verified = True
        own = dict(WeightPlan.from_resolved(resolved, include_frozen_vision=True).tensors())
        for name in (slot.name for slot in receiver.layouts[0].tensors):
            mine = own[name]
            sent = torch.empty_like(mine, memory_format=torch.contiguous_format)
            _broadcast(group, sent).wait()
            verified &= torch.equal(mine, sent) and (name not in received or torch.equal(received[name], sent))
        _settle(group, device)
        receiver.close()
        result = {"verified": bool(verified)}
    result.update({"sync": sync[options.warmup :], "raw": raw[options.warmup :]})
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(result))
