"""Policy-update throughput: vlmreg's packed update against padding, and against plain transformers.

RL-shaped samples (one image each, a short question, completions of random length) go through:
  vlmreg-packed   vlmreg's update (loss, backward, AdamW step) on packed micro-batches
  vlmreg-padded   the same update on padded micro-batches
  plain-padded    plain transformers forward + backward (labels loss on full logits) on padded batches of
                  --plain-batch samples, with gradient checkpointing, every parameter trainable: the baseline
                  measured in shared/NOTES.md (17% MFU on an H200)
  hf-frozen       the fair peer: plain transformers with the vision tower frozen (as vlmreg's update), no
                  checkpointing, sdpa, padded batches of --plain-batch, labels loss, AdamW step
  hf-liger-frozen hf-frozen with Liger kernels (fused linear cross-entropy: no full-vocabulary logits; RoPE,
                  RMSNorm, SwiGLU), what a user would pick to speed up transformers; needs `liger-kernel` and a GPU.
                  Liger patches transformers' classes for the whole process, so it always runs last.
  hf-trained, hf-liger-trained
                  the same two with the vision tower trained (its weights in the AdamW step), the peers of
                  vlmreg's update with --trainable-vision
Tokens are real (non-pad) tokens. MFU counts FLOPs per token on the ACTIVE parameters against --peak-tflops (per
GPU): 6 x (attention + norms + routers + shared experts + top-k routed experts' parameters + lm_head), the routed
experts at num_experts_per_tok / num_experts of their parameters, the input embedding (a lookup) not counted
(`update_ranks.active_matmul_params`); for a dense model with tied embeddings (the 2B shape) that is 6 x every
language-model parameter, as before. ``mfu_with_vision`` adds the vision encoder's matmul FLOPs.

Under ``torchrun`` the model is sharded with FSDP2 as the trainer shards it (`update_ranks`), each rank updating on
--samples samples of its own; tokens/s is over all ranks, MFU per GPU, seconds the slowest rank's. MoE models run
their routed experts as the family's ``prepare_model`` sets them (vlmreg modes; the Qwen MoE families: two grouped
GEMMs, `vlmreg_qwen_common.grouped_experts`); --experts times other implementations on the same model after it
(transformers' ``grouped_mm``, ``batched_mm``, ``eager``). Peer modes keep transformers' default (``grouped_mm``).

    python benchmarks/policy_update.py --size tiny --device cpu                       # CPU, tiny model
    python benchmarks/policy_update.py --size 2b --device cuda --attn varlen          # one H200
    torchrun --nproc_per_node 4 benchmarks/policy_update.py --family qwen3_vl_moe --size 30b-a3b --device cuda \
      --image-size 448 --samples 32 --min-completion 64 --max-completion 768 --budget 6144 \
      --modes vlmreg-packed --experts vlmreg_grouped,grouped_mm                       # 4 x H200, FSDP2
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import random
import re
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import attrs
import torch
from PIL import Image
from torch.profiler import ProfilerActivity, record_function
from torch.profiler import profile as torch_profile

import vlmreg
from vlmreg.config import parse_config
from vlmreg.data import ImageStore, image_part, text_part
from vlmreg.data.prompts import PromptEncoder
from vlmreg.inference.embedded import model_inputs
from vlmreg.modeling.attention import VARLEN
from vlmreg.modeling.recompute import GIB, RecomputePlanner
from vlmreg.sdk.engine import PromptRequest
from vlmreg.train.batching import make_microbatches
from vlmreg.train.optim import CompensatedAdamW
from vlmreg.train.samples import TrainingSample
from vlmreg.train.step import LossSettings, policy_update_sums

sys.path.insert(0, os.path.dirname(__file__))
import update_ranks

#: transformers as a user runs it (`plain_update`): its own forward, padded batches, AdamW; the vision tower frozen or
#: trained, with and without Liger's kernels
PEERS = ("hf-frozen", "hf-liger-frozen", "hf-trained", "hf-liger-trained")


def load(args: argparse.Namespace, *, trainable_vision: bool, checkpointing: bool, attn: str, ours: bool) -> Any:
    layers = {"layers": args.layers} if args.layers else {}
    config = parse_config(
        {
            "model": {
                "init": "random",
                "family": args.family,
                "size": args.size,
                **layers,
                "dtype": args.dtype,
                "attn_implementation": attn,
                "vlm": {"freeze_vision_encoder": not trainable_vision},
            },
            "trainer": {"device": args.device},
        }
    )
    loaded = vlmreg.load(config)
    if ours and loaded.resolved.descriptor.prepare_model:  # the peers run transformers as a user gets it
        loaded.resolved.descriptor.prepare_model(loaded.model)
    if checkpointing:
        loaded.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        kept = loaded.resolved.layers[len(loaded.resolved.layers) - args.keep_layers :] if args.keep_layers else []
        for layer in kept:  # these keep their activations (transformers' per-layer switch)
            layer.gradient_checkpointing = False
    processor = loaded.processor
    processor.image_processor.size = {**dict(processor.image_processor.size), "longest_edge": args.image_size**2}
    return loaded


def device_vision_inputs(loaded: Any) -> Any:
    """``loaded`` as before its family derived vision inputs on the host: no ``vision_call_inputs``, and the text
    model's own ``_deepstack_process`` (the instance's, which ``prepare_model`` set, removed)."""
    text = getattr(getattr(loaded.model, "model", None), "language_model", None)
    if text is not None:
        vars(text).pop("_deepstack_process", None)
    descriptor = attrs.evolve(loaded.resolved.descriptor, vision_call_inputs=None)
    return attrs.evolve(loaded, resolved=attrs.evolve(loaded.resolved, descriptor=descriptor))


def uncached_host_inputs(loaded: Any) -> Any:
    """``loaded`` as before its family reused host work across micro-batches (2026-11-27): the vision encoder's
    inputs from transformers' helpers on each micro-batch's whole grid, and each sample's M-RoPE positions from the
    model's ``get_rope_index`` on its whole row (no prompt's positions kept)."""
    from transformers.vision_utils import (  # noqa: PLC0415  (only for this comparison)
        get_vision_cu_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    def vision_call_inputs(encoder: Any, image_inputs: Any) -> dict[str, dict[str, Any]]:
        out = {}
        for name in ("image_grid_thw", "video_grid_thw"):
            grid = image_inputs.get(name)
            if grid is None or grid.device.type != "cpu" or not len(grid):
                continue
            indices, weights = get_vision_interpolation_indices_and_weights(
                grid,
                num_grid_per_side=encoder.num_grid_per_side,
                mode=encoder.interpolation_mode,
                align_corners=encoder.interpolation_align_corners,
                spatial_merge_size=encoder.config.spatial_merge_size,
            )
            cu_seqlens = get_vision_cu_seqlens(grid)
            out[name] = {
                "interp_indices": indices,
                "interp_weights": weights,
                "position_ids": get_vision_position_ids(grid, encoder.spatial_merge_size),
                "cu_seqlens": cu_seqlens,
                "max_seqlen": int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
            }
        return out

    def position_ids(model: Any, inputs: Any) -> torch.Tensor:
        media = {
            k: inputs[k]
            for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
            if inputs.get(k) is not None
        }
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        types = inputs.get("mm_token_type_ids", torch.zeros_like(ids))
        rope, _ = model.base_model.get_rope_index(ids, mm_token_type_ids=types, attention_mask=mask, **media)
        return torch.cat([((mask.cumsum(-1) - 1).clamp(min=0))[None], rope], dim=0)

    descriptor = loaded.resolved.descriptor
    if descriptor.vision_call_inputs is None or descriptor.position_ids is None:
        return loaded
    descriptor = attrs.evolve(descriptor, vision_call_inputs=vision_call_inputs, position_ids=position_ids)
    return attrs.evolve(loaded, resolved=attrs.evolve(loaded.resolved, descriptor=descriptor))


_ENCODERS: dict[int, PromptEncoder] = {}


def encoder(loaded: Any, store: ImageStore) -> PromptEncoder:
    """The run's prompt encoder, one per image store."""
    if id(store) not in _ENCODERS:
        _ENCODERS[id(store)] = PromptEncoder(loaded.processor, store, loaded.resolved.descriptor)
    return _ENCODERS[id(store)]


def make_samples(loaded: Any, store: ImageStore, args: argparse.Namespace, rank: int = 0) -> list[TrainingSample]:
    rng = random.Random(rank)
    samples = []
    for i in range(args.samples):
        colour = tuple(rng.randint(0, 255) for _ in range(3))
        image = store.add(Image.new("RGB", (args.image_size, args.image_size), colour))
        prompt = encoder(loaded, store).encode(
            [
                {
                    "role": "user",
                    "content": [
                        image_part(image),
                        text_part("Describe the image, then answer: which colour dominates?"),
                    ],
                }
            ]
        )
        completion = [rng.randint(10, 1000) for _ in range(rng.randint(args.min_completion, args.max_completion))]
        ids = prompt.input_ids + completion
        mask = [False] * len(prompt.input_ids) + [True] * len(completion)
        logprobs = [0.0] * len(prompt.input_ids) + [-rng.random() * 3 for _ in completion]
        samples.append(
            TrainingSample(
                ids, mask, logprobs, prompt.image_ids, prompt.image_spans, rng.choice([-1.0, 1.0]), i, f"s{i}"
            )
        )
    return samples


def count_vision_flops(encoder: torch.nn.Module):
    """Hooks on the vision encoder's linear layers adding up their matmul FLOPs per call: 2 x in x out per input row
    forward, and 4 x more backward where the weight trains (as the 6 x params per token of the language model). A
    forward run again in the backward pass (a block recomputing its activations) is not counted: it is no more work
    done, only work done twice. Returns a function that removes the hooks and gives the total."""
    total = [0]

    def add(module: torch.nn.Module, args: tuple) -> None:
        if torch._C._current_graph_task_id() != -1:  # inside backward: recomputation
            return
        rows = args[0].numel() // module.in_features
        total[0] += (6 if module.weight.requires_grad else 2) * module.in_features * module.out_features * rows

    handles = [m.register_forward_pre_hook(add) for m in encoder.modules() if isinstance(m, torch.nn.Linear)]

    def finish() -> int:
        for handle in handles:
            handle.remove()
        return total[0]

    return finish


def vision_flops_counter(encoder: torch.nn.Module, root: torch.nn.Module | None = None):
    """The vision encoder's matmul FLOPs over the calls made while counting, as `count_vision_flops` counts them, but
    without hooks inside the encoder while it runs: a hook on a linear layer of a compiled vision block breaks the
    block's graph at that layer (the layers then run eagerly, and the backward with them), so the timed steps would not
    run the code the trainer runs. Instead one hook on the encoder itself (called eagerly) notes each call's rows
    (``pixel_values``' first dimension: patch rows, or images), and when counting ends one call, again, eagerly and
    without gradients, is counted by `count_vision_flops`; every call's count is its rows times that call's FLOPs per
    row (each linear layer's rows are a fixed fraction of the encoder's). Under FSDP2 every rank must end counting
    together, and ``root`` (the sharded model) has its own parameters (the encoder's outside its blocks, which the
    root's forward would gather) gathered for that call. Returns a function that removes the hook and gives the
    total."""
    rows: list[int] = []
    first: list[tuple[tuple, dict]] = []

    def note(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if torch._C._current_graph_task_id() != -1 or not args:  # inside backward: recomputation
            return
        rows.append(int(args[0].shape[0]))
        if not first:
            first.append((args, dict(kwargs)))

    handle = encoder.register_forward_pre_hook(note, with_kwargs=True)

    def finish() -> float:
        handle.remove()
        if not rows:
            return 0.0
        args, kwargs = first.pop()
        count = count_vision_flops(encoder)
        sharded = callable(getattr(root, "unshard", None))  # FSDP2's FSDPModule
        if sharded:
            root.unshard()  # type: ignore[union-attr]
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                encoder(*args, **kwargs)
        finally:
            if sharded:
                root.reshard()  # type: ignore[union-attr]
        return count() / rows[0] * sum(rows)

    return finish


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


#: Each timed call's seconds, of the last `time_it` (this rank's).
TIMES: list[float] = []
#: Per vlmreg step, host seconds from the step's start: until its first micro-batch was built, until everything was
#: queued (just before the sums are read), and waiting while they are read (how far the GPU was behind the host)
PHASES: dict[str, list[float]] = collections.defaultdict(list)
TIMED_PHASES: dict[str, float] = {}  # their medians over `time_it`'s timed calls


def time_it(fn, args: argparse.Namespace) -> float:
    """The median seconds of --iters calls after --warmup (each call's in `TIMES`)."""
    for _ in range(args.warmup):
        fn()
    sync(args.device)
    times = []
    PHASES.clear()
    for _ in range(args.iters):
        started = time.perf_counter()
        fn()
        sync(args.device)
        times.append(time.perf_counter() - started)
    TIMES[:] = times
    TIMED_PHASES.clear()
    TIMED_PHASES.update({name: statistics.median(values) for name, values in PHASES.items() if values})
    return statistics.median(times)


def vlmreg_update(
    loaded: Any,
    store: ImageStore,
    samples: list[TrainingSample],
    args: argparse.Namespace,
    *,
    packed: bool,
    ctx: Any = None,
):
    params = [p for p in loaded.model.parameters() if p.requires_grad]
    if args.optimizer == "compensated" and any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
        optimizer = CompensatedAdamW(params, lr=1e-6)  # what the trainer steps 16-bit weights with
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-6, fused=update_ranks.fused(params, args.device))
    objective = LossSettings("grpo", 0.2, 0.28, True, 2.0, 0.0, 1.0)
    device = loaded.device
    planner = None
    if args.memory_budget_gib:  # trainer.memory_budget_gib: which layers and vision blocks recompute, per micro-batch
        planner = RecomputePlanner(
            loaded.resolved,
            int(args.memory_budget_gib * GIB),
            optimizer=optimizer,
            prefetch=args.prefetch,  # the layers FSDP2 gathers ahead: in the plan's reserve
            log=lambda s: print(s, file=sys.stderr) if ctx is None or ctx.is_main else None,
        )

    world = ctx.world if ctx is not None else 1

    def step() -> None:
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        batches = make_microbatches(
            samples,
            loaded.resolved,
            encoder(loaded, store),
            budget=args.budget,
            packed=packed,
            device=device,
            prefetch=ctx is None,
        )
        idle = 0
        if ctx is not None:  # every rank makes as many passes as the busiest
            batches, idle = update_ranks.even_out(list(batches), ctx)
        batches[0]
        PHASES["first_microbatch_s"].append(time.perf_counter() - started)
        if planner is not None:
            planner.begin_step()
        sums = policy_update_sums(
            loaded.resolved,
            batches,
            objective,
            num_samples=len(samples) * world,
            loss_scale=float(world),
            idle=idle,
            recompute=planner,
        )
        if args.sums_first:  # as before: the host waits for the backward, then queues the optimizer step
            sums.result()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        queued = time.perf_counter()
        sums.result()  # as the trainer reads them: after the optimizer step is queued
        PHASES["host_queued_s"].append(queued - started)
        PHASES["final_wait_s"].append(time.perf_counter() - queued)
        if planner is not None:  # as the trainer does: a prediction short of the allocator's peak widens the margin
            planner.end_step(torch.cuda.max_memory_allocated() if args.device == "cuda" else None)

    step.planner = planner  # type: ignore[attr-defined]
    return step


def plain_update(
    loaded: Any, store: ImageStore, samples: list[TrainingSample], args: argparse.Namespace, *, optimize: bool
):
    """transformers' own loss on padded batches; with ``optimize`` also gradient clipping and a fused AdamW step."""
    model, device = loaded.model, loaded.device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=update_ranks.fused(params, args.device)) if optimize else None
    batches = []
    for start in range(0, len(samples), args.plain_batch):
        chunk = samples[start : start + args.plain_batch]
        requests = [PromptRequest(s.input_ids, s.image_ids, s.image_spans) for s in chunk]
        inputs = model_inputs(requests, encoder(loaded, store), device, left_pad=False)
        labels = torch.full_like(inputs["input_ids"], -100)
        for r, s in enumerate(chunk):
            labels[r, : len(s)] = torch.tensor(
                [t if m else -100 for t, m in zip(s.input_ids, s.loss_mask, strict=True)]
            )
        batches.append({**inputs, "labels": labels})

    def step() -> None:
        model.zero_grad(set_to_none=True)
        for batch in batches:
            model(**batch, use_cache=False).loss.backward()
        if optimizer is not None:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()

    return step


def apply_liger(family: str) -> None:
    """Liger's kernels for the family's transformers classes (before the model is built, so every module is patched)."""
    # deferred: fails to import here (ModuleNotFoundError: No module named 'liger_kernel')
    from liger_kernel.transformers import monkey_patch  # noqa: PLC0415

    patch = getattr(monkey_patch, f"apply_liger_kernel_to_{family}", None)
    if patch is None:
        raise SystemExit(f"liger-kernel has no apply_liger_kernel_to_{family}")
    patch(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)


def profile(step, mode: str, args: argparse.Namespace) -> None:
    """One step under torch.profiler: the ops that take the GPU's time, how much of the step the GPU is busy, and how
    much of that is collectives (NCCL kernels, which run on their own stream beside the compute). Every rank runs the
    step (its collectives need them all); rank 0 prints."""

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    # a trace for reading elsewhere leaves the stacks out: they slow the host and make the file too large to move
    stacks = args.device == "cuda" and not args.trace
    with torch_profile(activities=activities, with_stack=stacks) as prof, labelled_phases():
        started = time.perf_counter()
        with record_function(STEP):
            step()
        sync(args.device)
        wall = time.perf_counter() - started
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    if args.trace:  # torch gzips a path ending in .gz
        prof.export_chrome_trace(trace := f"{args.trace}.{mode}.json.gz")
        print(f"== trace: {trace} ({os.path.getsize(trace) / 2**20:.1f} MiB)", file=sys.stderr)
    key = "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    kinds = kernel_seconds(prof.events()) if args.device == "cuda" else {}
    print(
        f"== profile {mode}: step {wall:.3f} s under the profiler; GPU kernels (s, summed over streams): "
        + ", ".join(f"{kind} {seconds:.3f}" for kind, seconds in kinds.items()),
        file=sys.stderr,
    )
    print(averages.table(sort_by=key, row_limit=30, max_name_column_width=60), file=sys.stderr)
    if args.device == "cuda":
        idle_gaps(prof.events())
        idle_owners(prof.events())
        host_waits(prof.events())


STEP = "phase: step"


def on_gpu(event: Any) -> bool:
    """A kernel or copy on the GPU (not the GPU-side range the profiler adds for a ``record_function`` label)."""
    return event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("phase: ")


@contextlib.contextmanager
def labelled_phases() -> Iterator[None]:
    """While inside, the profiler sees the step's phases as ranges of their own (``record_function``): waiting for or
    building a micro-batch, each micro-batch's forward, each backward, gradient clipping."""
    # deferred: only for this mode; the modules whose attributes are wrapped
    import vlmreg.train.step as step_module  # noqa: PLC0415
    from vlmreg.train import batching  # noqa: PLC0415

    wrapped = [
        (step_module, "selected_logprobs", "phase: forward"),
        (batching.MicroBatches, "__getitem__", "phase: micro-batch"),
        (torch.Tensor, "backward", "phase: backward"),
        (torch.nn.utils, "clip_grad_norm_", "phase: clip"),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in wrapped]

    def labelled(real: Any, label: str) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            with record_function(label):
                return real(*a, **k)

        return call

    for (owner, name, label), (_, _, real) in zip(wrapped, originals, strict=True):
        setattr(owner, name, labelled(real, label))
    try:
        yield
    finally:
        for owner, name, real in originals:
            setattr(owner, name, real)


def idle_owners(events: Any, least_us: float = 20.0) -> None:
    """What the step's own thread was doing while the GPU idled (gaps over ``least_us``): the innermost phase
    (`labelled_phases`) and the innermost op it was in at the gap's middle ("python" where no op was running)."""
    steps = [e for e in events if e.name == STEP]
    if not steps:
        return
    thread = steps[0].thread
    cpu = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CPU and e.thread == thread
    )
    starts = [c[0] for c in cpu]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if on_gpu(e))
    owners: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    reach = spans[0][1] if spans else 0.0
    for start, end in spans[1:]:
        if start - reach > least_us:
            middle = (start + reach) / 2
            at = bisect.bisect_right(starts, middle)
            phase, op = "outside the step", "python"
            found_op = found_phase = False
            for begin, finish, name in reversed(cpu[max(0, at - 4000) : at]):
                if finish < middle:
                    continue
                if not found_op and not name.startswith("phase: "):
                    op, found_op = name, True
                if name.startswith("phase: ") and not found_phase:
                    phase, found_phase = name.removeprefix("phase: "), True
                if found_phase and (found_op or begin < middle - 1e6):
                    break
            owners[f"{phase}: {op}"] += (start - reach) / 1e3
            counts[f"{phase}: {op}"] += 1
        reach = max(reach, end)
    print(f"== idle GPU by what the step's thread was doing: {sum(owners.values()):.1f} ms", file=sys.stderr)
    for where, ms in owners.most_common(20):
        print(f"{ms:9.1f} ms {counts[where]:5d} gaps  {where[:150]}", file=sys.stderr)


#: CUDA runtime calls in which the host waits for the GPU
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def host_waits(events: Any) -> None:
    """Where the host waited for the GPU in the profiled step: each wait by the op it happened in (innermost op first)
    and, in the backward pass, the autograd node that ran it."""
    found: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.name not in WAITS:
            continue
        names, parent = [], getattr(event, "cpu_parent", None)
        while parent is not None:
            names.append(parent.name)
            parent = getattr(parent, "cpu_parent", None)
        nodes = [n.removeprefix("autograd::engine::evaluate_function: ") for n in names if "evaluate_function" in n]
        ops = [n for n in names if "evaluate_function" not in n]
        where = " < ".join(ops[:3]) or "(no op)"
        found[f"{where}{f' [backward: {nodes[-1]}]' if nodes else ''}"] += 1
    print(f"== host waits (profiled): {sum(found.values())}", file=sys.stderr)
    for where, count in found.most_common(20):
        print(f"{count:6d}  {where}", file=sys.stderr)


def _where(event: Any) -> str:
    """The op that launched a GPU event and the innermost source line outside torch that called it."""
    parent = getattr(event, "cpu_parent", None)
    names, line = [], ""
    while parent is not None:
        names.append(parent.name)
        frames = [f for f in (getattr(parent, "stack", None) or []) if not TORCH_FILE.search(f)]
        if frames and not line:
            line = frames[0].rsplit("/", 2)[-1]
        parent = getattr(parent, "cpu_parent", None)
    return f"{' < '.join(names[:2]) or event.name[:40]} @ {line or '?'}"


def idle_gaps(events: Any, least_us: float = 20.0) -> None:
    """Where the GPU waits for the host: the gaps between GPU events (kernels and copies, any stream) longer than
    ``least_us``, summed by what ran next (the op that launched it and the source line above it)."""
    spans = sorted(((e.time_range.start, e.time_range.end, e) for e in events if on_gpu(e)), key=lambda s: s[:2])
    if not spans:
        return
    gaps: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    reach, idle = spans[0][1], 0.0
    for start, end, event in spans[1:]:
        if start - reach > least_us:
            where = _where(event)
            gaps[where] += (start - reach) / 1e6
            counts[where] += 1
            idle += (start - reach) / 1e6
        reach = max(reach, end)
    window = (reach - spans[0][0]) / 1e6
    print(
        f"== idle GPU: {idle:.3f} s in gaps over {least_us:g} us, of {window:.3f} s from first to last GPU event",
        file=sys.stderr,
    )
    for where, seconds in gaps.most_common(15):
        print(f"{seconds * 1e3:9.1f} ms {counts[where]:5d} gaps  before {where}", file=sys.stderr)


#: A source file of torch itself (a conda env may be named torch: match the package folder)
TORCH_FILE = re.compile(r"[/\\\\](site|dist)-packages[/\\\\]torch[/\\\\]")


def host_syncs(step, mode: str, args: argparse.Namespace) -> None:
    """One step with ``torch.cuda.set_sync_debug_mode("warn")``: each place the host waited for the GPU (the source
    line of the call that synchronised, from the warning's stack), with how often; rank 0 prints."""
    if args.device != "cuda":
        return
    places: collections.Counter[str] = collections.Counter()
    stacks: dict[str, list[str]] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        stack = traceback.extract_stack()[:-1]
        frames = [f for f in stack if not TORCH_FILE.search(f.filename) and "warnings" not in f.filename]
        where = " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
        places[where] += 1
        if places[where] == 1:  # the first time: the whole stack, innermost first
            stacks[where] = [f"{f.filename.rsplit('/', 3)[-1]}:{f.lineno} {f.name}" for f in stack[-14:][::-1]]

    torch.cuda.synchronize()
    with warnings.catch_warnings():  # restores showwarning and the filters after
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    print(f"== host syncs {mode}: {sum(places.values())} in one step", file=sys.stderr)
    for where, count in places.most_common(25):
        print(f"{count:6d}  {where}", file=sys.stderr)
    for where, _ in places.most_common(3):
        print(f"-- {where}:\n    " + "\n    ".join(stacks[where]), file=sys.stderr)


def host_profile(step, mode: str, args: argparse.Namespace) -> None:
    """One step under cProfile (the thread that runs it; rank 0 prints): the functions the host spends the step in,
    by their own time and with what they call."""
    profiler = cProfile.Profile()
    sync(args.device)
    started = time.perf_counter()
    profiler.enable()
    step()
    profiler.disable()
    sync(args.device)
    wall = time.perf_counter() - started
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    stats = pstats.Stats(profiler)
    print(f"== host profile {mode}: step {wall:.3f} s under cProfile", file=sys.stderr)
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        stats.stream = out
        stats.sort_stats(order).print_stats(35)
        lines = [line for line in out.getvalue().splitlines() if line.strip()]
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
        print(f"-- by {order}", file=sys.stderr)
        for line in lines[start : start + 36]:
            print(re.sub(r"/\S*/(site|dist)-packages/", "", line)[:200], file=sys.stderr)


#: Kernel name fragments by kind, the first that matches wins (lower case).
KERNEL_KINDS = (
    ("collectives", ("nccl",)),
    ("attention", ("flash", "fmha", "attention")),  # before matmuls: FlashAttention's names hold "cutlass"
    ("matmuls", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas")),
    ("copies and indexing", ("copy", "index", "gather", "scatter", "cat", "sort", "radix", "split")),
    ("elementwise and reductions", ("elementwise", "vectorized", "reduce", "softmax", "norm")),
)


def kernel_seconds(events: Any) -> dict[str, float]:
    """GPU kernel time by kind (each kernel once: the op rows of the table also carry their kernels' time)."""
    totals = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for event in events:
        if not on_gpu(event):
            continue
        name = event.name.lower()
        kind = next((k for k, parts in KERNEL_KINDS if any(p in name for p in parts)), "other")
        totals[kind] += event.time_range.elapsed_us() / 1e6
    return totals | {"all": sum(totals.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_vl")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--attn", default="varlen", help="attention of vlmreg's update: varlen (per sample) or sdpa (dense mask)"
    )
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--min-completion", type=int, default=8)
    parser.add_argument("--max-completion", type=int, default=128)
    parser.add_argument("--budget", type=int, default=4096, help="tokens per vlmreg micro-batch")
    parser.add_argument("--plain-batch", type=int, default=8)
    parser.add_argument(
        "--modes",
        default="vlmreg-packed,vlmreg-padded,plain-padded",
        help="any of vlmreg-packed, vlmreg-padded, plain-padded, hf-frozen, hf-liger-frozen, hf-trained, "
        "hf-liger-trained",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each decoder layer and vision block (vlmreg modes), as trainer.compile",
    )
    parser.add_argument(
        "--optimizer",
        default="compensated",
        choices=["compensated", "fused"],
        help="vlmreg modes: the trainer's CompensatedAdamW for 16-bit weights, or torch's fused AdamW",
    )
    parser.add_argument(
        "--trainable-vision",
        action="store_true",
        help="vlmreg modes: train the vision tower too (mfu_with_vision then counts its 6 x params x patches)",
    )
    parser.add_argument(
        "--per-image-vision",
        action="store_true",
        help="vlmreg modes: the vision encoder attends once per image (the text's varlen implementation), as before "
        "it got its own",
    )
    parser.add_argument(
        "--sums-first",
        action="store_true",
        help="vlmreg modes: read the step's sums before queueing gradient clipping and the optimizer step (the host "
        "waits for the backward first), as the trainer did before it read them after",
    )
    parser.add_argument(
        "--device-vision-inputs",
        action="store_true",
        help="vlmreg modes: the vision encoder derives its per-call inputs on the device and DeepStack indexes by "
        "boolean masks (the host waits for the GPU in both), as before the family's vision_call_inputs and "
        "prepare_deepstack",
    )
    parser.add_argument(
        "--uncached-host-inputs",
        action="store_true",
        help="vlmreg modes: each micro-batch's vision encoder inputs and each sample's M-RoPE positions derived from "
        "scratch with transformers' helpers, as before the Qwen families kept them per grid shape and prompt",
    )
    parser.add_argument(
        "--memory-budget-gib",
        type=float,
        default=None,
        help="vlmreg modes: trainer.memory_budget_gib (layers and vision blocks recompute their activations to stay "
        "within it; under torchrun each rank plans for itself)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after timing, profile one step of each mode: top CUDA ops, GPU busy time",
    )
    parser.add_argument(
        "--trace",
        default=None,
        metavar="PREFIX",
        help="with --profile: also write the profiled step (without Python stacks) as PREFIX.MODE.json.gz",
    )
    parser.add_argument(
        "--sync-debug",
        action="store_true",
        help="after timing, one step of each mode under torch.cuda's sync debug mode: where the host waits on the GPU",
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="after timing, one step of each mode under cProfile (the calling thread): where the host's time goes",
    )
    parser.add_argument(
        "--hooked-vision-count",
        action="store_true",
        help="count the vision FLOPs with hooks on its linear layers during the timed steps, as before 2026-11-28 "
        "(they break compiled vision blocks' graphs at every linear layer; for an A/B)",
    )
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 matmul peak (H200: 790)")
    parser.add_argument(
        "--keep-layers", type=int, default=0, help="with --checkpointing: the last N decoder layers keep activations"
    )
    parser.add_argument(
        "--prefetch", type=int, default=0, help="FSDP2: explicit prefetching of this many decoder layers (0: its own)"
    )
    parser.add_argument("--layers", type=int, default=None, help="model.layers: the shape's first N decoder layers")
    parser.add_argument(
        "--experts",
        default=None,
        help="vlmreg modes, MoE models: after the family's own experts (as prepare_model sets them), time these "
        "implementations on the same model too, comma-separated (vlmreg_grouped, grouped_mm, batched_mm, eager); "
        "each gets a result 'MODE[IMPLEMENTATION]'",
    )
    parser.add_argument(
        "--checkpointing", action="store_true", help="vlmreg modes: gradient checkpointing of every layer"
    )
    parser.add_argument("--output", default=None, help="also write the JSON here (rank 0)")
    args = parser.parse_args()
    ctx = update_ranks.join(args.device)

    known = PEERS + ("vlmreg-packed", "vlmreg-padded", "plain-padded")
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in known]:
        raise SystemExit(f"unknown mode(s) {unknown}: choose from {', '.join(known)}")
    modes.sort(key=lambda m: m.startswith("hf-liger"))  # Liger's patches stay for the rest of the process
    results: dict[str, Any] = {}
    for mode in modes:
        torch.manual_seed(0)
        ours = mode.startswith("vlmreg")
        if mode.startswith("hf-liger"):
            apply_liger(args.family)
        baseline = mode == "plain-padded"
        loaded = load(
            args,
            trainable_vision=baseline or (ours and args.trainable_vision) or mode.endswith("-trained"),
            checkpointing=baseline or (ours and args.checkpointing),
            attn=args.attn if ours else "sdpa",
            ours=ours,
        )
        counts = update_ranks.active_matmul_params(loaded)  # before sharding: whole tensors
        update_ranks.shard(loaded, ctx, args.prefetch)
        store = ImageStore(pin_memory=args.device == "cuda")  # as the trainer's on a GPU
        samples = make_samples(loaded, store, args, rank=ctx.rank if ctx is not None else 0)
        if args.per_image_vision and ours:
            loaded.resolved.vision_encoder.config._attn_implementation_internal = VARLEN
        if args.device_vision_inputs and ours:
            loaded = device_vision_inputs(loaded)
        if args.uncached_host_inputs and ours:
            loaded = uncached_host_inputs(loaded)
        if args.compile and ours:  # as trainer.compile: each decoder layer and vision block its own compiled call
            for block in (*loaded.resolved.layers, *(loaded.resolved.vision_blocks or ())):
                block.compile(dynamic=True)
        variants = [None] + ([e for e in args.experts.split(",") if e] if ours and args.experts else [])
        for experts in variants:
            key = mode if experts is None else f"{mode}[{experts}]"
            if experts is not None:
                if not hasattr(loaded.model, "set_experts_implementation"):
                    results[key] = {"error": "this transformers cannot switch experts implementations"}
                    continue
                if experts == "vlmreg_grouped":
                    # deferred: a family plugin's module, only where asked for
                    from vlmreg_qwen_common.grouped_experts import register_grouped_experts  # noqa: PLC0415

                    register_grouped_experts()
                loaded.model.set_experts_implementation(experts)
            if ours:
                step = vlmreg_update(loaded, store, samples, args, packed=mode == "vlmreg-packed", ctx=ctx)
            else:
                step = plain_update(loaded, store, samples, args, optimize=not baseline)
            results[key] = measure(mode, step, loaded, samples, args, ctx, counts)
            if args.output and (ctx is None or ctx.is_main):  # kept should a later mode fail (out of memory)
                with open(args.output, "w") as f:
                    json.dump(results, f, indent=2)
            del step
            update_ranks.release(args.device)
        del loaded
        update_ranks.release(args.device)
    if "vlmreg-packed" in results and "plain-padded" in results:
        results["packed_vs_plain"] = round(
            results["vlmreg-packed"]["tokens_per_s"] / results["plain-padded"]["tokens_per_s"], 2
        )
    for peer in PEERS:
        if "vlmreg-packed" in results and peer in results:
            results[f"packed_vs_{peer}"] = round(
                results["vlmreg-packed"]["tokens_per_s"] / results[peer]["tokens_per_s"], 2
            )
    if "vlmreg-packed" in results and "vlmreg-padded" in results:
        results["packed_vs_padded"] = round(
            results["vlmreg-packed"]["tokens_per_s"] / results["vlmreg-padded"]["tokens_per_s"], 2
        )
    results["setup"] = {k: v for k, v in vars(args).items()} | {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
    }
    results["setup"]["world_size"] = ctx.world if ctx is not None else 1
    if ctx is None or ctx.is_main:
        print(json.dumps(results, indent=2))
        if args.output:
            with open(args.output, "w") as f:
                json.dump(results, f, indent=2)
    if ctx is not None:
        torch.distributed.destroy_process_group()


def measure(
    mode: str, step: Any, loaded: Any, samples: list[TrainingSample], args: argparse.Namespace, ctx: Any, counts: tuple
) -> dict[str, Any]:
    """Time ``step`` and count what it did: seconds (slowest rank), tokens (all ranks), MFU on active parameters."""
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    vision_flops = (
        count_vision_flops(loaded.resolved.vision_encoder)
        if args.hooked_vision_count
        else vision_flops_counter(loaded.resolved.vision_encoder, root=loaded.model)
    )
    seconds = time_it(step, args)
    vision_flops = vision_flops() / (args.warmup + args.iters)
    tokens = sum(len(s) for s in samples)
    if args.profile:
        profile(step, mode, args)
    if args.sync_debug:
        host_syncs(step, mode, args)
    if args.host_profile:
        host_profile(step, mode, args)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    world = ctx.world if ctx is not None else 1
    seconds, tokens, peak = update_ranks.reduce(ctx, seconds, tokens, peak)
    vision_flops = update_ranks.reduce(ctx, 0.0, int(vision_flops), None)[1]
    active, total = counts
    vision_trains = all(p.requires_grad for b in loaded.resolved.vision_blocks for p in b.parameters())
    tokens_per_s = tokens / seconds
    peak_flops = args.peak_tflops * 1e12 * world
    result = {
        "seconds_per_step": round(seconds, 4),
        "seconds_each": [round(t, 3) for t in TIMES],  # rank 0's timed calls
        # medians over the timed calls (vlmreg modes): see PHASES
        **{name: round(seconds, 4) for name, seconds in TIMED_PHASES.items()},
        "tokens": tokens,
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": round(6 * active * tokens_per_s / peak_flops, 4),
        # the vision encoder's matmul FLOPs counted too (its trained weights 6 x, its frozen ones 2 x, per row)
        "mfu_with_vision": round((6 * active * tokens + vision_flops) / seconds / peak_flops, 4),
        "vision_flops_per_step": int(vision_flops),  # all ranks
        "active_params": active,
        "language_params": total,
        "experts": update_ranks.experts_in_use(loaded.model),
        "world_size": world,
        "vision_tower_trains": vision_trains,
        "peak_memory_gib": round(peak, 2) if peak is not None else None,
        # the caching allocator: its reserved peak, and how often it had to free its cache and retry (slow) near the top
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if args.device == "cuda" else None,
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries") if args.device == "cuda" else None,
    }
    # each micro-batch's plan in the last step: what recomputed, the predicted peak
    if getattr(step, "planner", None) is not None:
        result["recompute"] = list(step.planner.history)
        result["recompute_margin_gib"] = round(step.planner.margin / 2**30, 2)
        result["recompute_measured"] = (
            step.planner.device_measured
            | {
                f"{m.name} per row (bytes kept, kept recomputing)": [round(m.saved_per_row), round(m.input_per_row)]
                for m in step.planner.modules
                if m.name in ("layers.0", "vision_blocks.0")
            }
            | {"rest per token": round(step.planner.rest_per_token)}
        )
    return result


if __name__ == "__main__":
    main()
