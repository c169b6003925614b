"""Micro-batches by token budget, packed (segments in one row, positions restart per segment) or padded.

Positions come from the family: a descriptor's ``position_ids`` provider (3-D M-RoPE, say)
is called per segment, so a packed row carries exactly the positions each sample would have alone. Without
a provider, positions are ``0..n-1`` per segment, from which transformers builds a block-diagonal mask.
Token-aligned inputs and image inputs come from the family's processor through the `PromptEncoder`.
A family that declares ``packing=False`` (attention that a packed row cannot express, such as
bidirectional blocks over images) always gets padded micro-batches. A ``prefix_lm`` family (which the descriptor
holds to ``packing=False``) gets the input ``prefix_lm`` names, 0 over each prompt and 1 over its completion
(`prefix_lm_types`), from which transformers builds the bidirectional prefix mask.

Under torchrun a micro-batch may carry a stand-in image segment without loss, counted nowhere, so that every rank's
vision tower runs in the same micro-batches (`vlmreg.train.vision_ranks`).

With ``prefetch=True`` the micro-batches are built one ahead on a background thread while the caller's GPU work
on the previous one runs (building them is host work: collating image tensors, positions, the copy to the device).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import overload

import attrs
import torch

from vlmreg.data.prompts import PromptEncoder
from vlmreg.data.store import pad_token_id
from vlmreg.modeling.attention import PACKED_TOKENS
from vlmreg.modeling.vision_calls import VISION_CALLS, host_vision_inputs
from vlmreg.resolution import ResolvedFamily
from vlmreg.train.samples import TrainingSample

#: ``sample_index`` where no sample of the step is: padding, and a stand-in segment's tokens
_NO_SAMPLE = -1

__all__ = [
    "MicroBatch",
    "MicroBatches",
    "loss_tokens",
    "make_microbatches",
    "microbatch_plan",
    "plan_microbatches",
    "prefix_lm_types",
]


@attrs.frozen(eq=False)
class MicroBatch:
    """Model inputs plus, per token position, what the loss needs (shifted: position t predicts token t+1)."""

    inputs: dict[str, torch.Tensor]
    targets: torch.Tensor  # (B, L) next token
    loss_mask: torch.Tensor  # (B, L) bool: targets that are generated tokens
    rollout_logprobs: torch.Tensor  # (B, L)
    advantages: torch.Tensor  # (B, L)
    sample_index: torch.Tensor  # (B, L) index into the step's samples (-1 where no sample: padding, a stand-in)
    samples: tuple[int, ...]
    tokens: int  # the step's samples' tokens (no padding, no stand-in segment)
    # made on the CPU with the rest, so the update needs no device-to-host sync to find them:
    selected: torch.Tensor | None = None  # (N,) long: flat (row-major) positions where loss_mask is true
    # (N,) long: each selected token's sample, numbered 0..num_sequences-1 in order
    sequence: torch.Tensor | None = None
    num_sequences: int = 0

    @property
    def selection(self) -> torch.Tensor:
        """What `selected_logprobs` takes as ``select``: the flat positions when known, else the mask."""
        return self.selected if self.selected is not None else self.loss_mask

    @property
    def loss_tokens(self) -> int:
        """Tokens that get a loss (known on the host: no sync)."""
        return int(self.selected.numel()) if self.selected is not None else int(self.loss_mask.sum())

    def pick(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (B, L, ...) at the loss tokens, flattened in row order (``values[loss_mask]``, without a sync)."""
        if self.selected is None:
            return values[self.loss_mask]
        return values.flatten(0, 1).index_select(0, self.selected)


def plan_microbatches(lengths: Sequence[int], budget: int, *, packed: bool) -> list[list[int]]:
    """Group sample indices so each micro-batch fits ``budget`` tokens (padded width x rows when not packed).

    First-fit decreasing: long samples first, each into the first micro-batch with room. The smallest micro-batch
    comes first (ties in order): it is built soonest, so the GPU starts sooner while the next one is built.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    used: list[int] = []  # packed: total tokens; padded: longest sample (rows * longest must fit)
    for i in order:
        for b, members in enumerate(bins):
            fits = used[b] + lengths[i] <= budget if packed else max(used[b], lengths[i]) * (len(members) + 1) <= budget
            if fits:
                members.append(i)
                used[b] = used[b] + lengths[i] if packed else max(used[b], lengths[i])
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    sizes = [used[b] if packed else used[b] * len(members) for b, members in enumerate(bins)]
    return [sorted(bins[b]) for b in sorted(range(len(bins)), key=lambda b: sizes[b])]


def _positions(
    resolved: ResolvedFamily, ids: torch.Tensor, mask: torch.Tensor, extra: dict[str, torch.Tensor]
) -> torch.Tensor:
    provider = resolved.descriptor.position_ids
    if provider is not None:
        return provider(resolved.model, {"input_ids": ids, "attention_mask": mask, **extra})
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _placed(samples: Sequence[TrainingSample], offsets: Sequence[int]) -> list[tuple[int, str, tuple[int, int]]]:
    """``(offset, image_id, span)`` of every image of ``samples`` placed at ``offsets`` in one row."""
    return [
        (offset, i, span)
        for s, offset in zip(samples, offsets, strict=True)
        for i, span in zip(s.image_ids, s.image_spans, strict=True)
    ]


class MicroBatches(Sequence[MicroBatch]):
    """A step's micro-batches, built on first access, the next one ahead on a background thread; each is built once."""

    def __init__(self, count: int, build: Callable[[int], MicroBatch]) -> None:
        self._count, self._build = count, build
        self._futures: dict[int, Future[MicroBatch]] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="vlmreg-microbatches"
        )
        self._start(0)

    def _start(self, index: int) -> None:
        with self._lock:
            if index >= self._count or index in self._futures:
                return
            assert self._pool is not None
            self._futures[index] = self._pool.submit(self._build, index)
            if len(self._futures) == self._count:
                self._pool.shutdown(wait=False)  # the last one is queued: the thread ends after it
                self._pool = None

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> MicroBatch: ...
    @overload
    def __getitem__(self, index: slice) -> list[MicroBatch]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(index)
        self._start(index)
        self._start(index + 1)  # built while the caller works on this one
        return self._futures[index].result()

    def __iter__(self) -> Iterator[MicroBatch]:
        return (self[i] for i in range(self._count))


def microbatch_plan(
    samples: Sequence[TrainingSample], resolved: ResolvedFamily, *, budget: int, packed: bool
) -> list[list[int]]:
    """Which samples each of `make_microbatches`'s micro-batches holds (by index), without building any."""
    packed = packed and resolved.descriptor.packing
    return plan_microbatches([len(s) for s in samples], budget, packed=packed)


def make_microbatches(
    samples: Sequence[TrainingSample],
    resolved: ResolvedFamily,
    encoder: PromptEncoder,
    *,
    budget: int,
    packed: bool,
    device: torch.device,
    prefetch: bool = False,
    plan: Sequence[Sequence[int]] | None = None,
    stand_ins: Mapping[int, TrainingSample] | None = None,
) -> Sequence[MicroBatch]:
    """A step's micro-batches; each sample's images are checked against its tokens first (before any is built).

    ``packed`` is ignored (padded micro-batches) when the family declares ``packing=False``. ``prefetch``: a
    `MicroBatches` that builds each on first access and the next one ahead on a thread; otherwise a list.
    ``plan``: the samples of each micro-batch (by default `microbatch_plan`'s); a group that comes again (an idle
    repeat) is built once. ``stand_ins``: by micro-batch, a sample without loss added to it as a segment (padded: a
    row) of its own, counted nowhere (`vlmreg.train.vision_ranks`).
    """
    packed = packed and resolved.descriptor.packing
    if plan is None:
        plan = plan_microbatches([len(s) for s in samples], budget, packed=packed)
    build = _packed if packed else _padded
    stand_ins = stand_ins or {}
    extra = list({id(s): s for s in stand_ins.values()}.values())
    for s in [*samples, *extra]:
        encoder.check(s.input_ids, s.image_ids, s.image_spans, s.example_id)
    if any(any(s.loss_mask) for s in extra):
        raise ValueError("a stand-in segment must have no loss token")
    built: dict[tuple[tuple[int, ...], TrainingSample | None], MicroBatch] = {}

    def one(index: int) -> MicroBatch:
        members, stand_in = tuple(plan[index]), stand_ins.get(index)
        key = (members, stand_in)
        if key not in built:  # built in order (one thread): a repeat finds its original
            chosen = [samples[i] for i in members]
            if stand_in is not None:
                chosen, members = [*chosen, stand_in], (*members, _NO_SAMPLE)
            built[key] = build(chosen, members, resolved, encoder, device)
        return built[key]

    if prefetch:
        return MicroBatches(len(plan), one)
    return [one(i) for i in range(len(plan))]


def loss_tokens(samples: Sequence[TrainingSample]) -> int:
    """Tokens that get a loss in these samples' micro-batches (each sample's generated tokens after its first), without
    building them."""
    return sum(sum(s.loss_mask[1:]) for s in samples)


def _loss_tensors(
    samples: Sequence[TrainingSample], members: tuple[int, ...], rows: list[list[tuple[int, int]]], width: int
):
    """Shifted per-position targets/mask/logprobs/advantages; ``rows`` lists (sample, offset) per row. Filled as
    Python lists and made tensors once each (a tensor per sample and field costs the host more than the whole)."""
    n = len(rows)
    targets, loss_mask = [[0] * width for _ in range(n)], [[False] * width for _ in range(n)]
    logprobs, advantages = [[0.0] * width for _ in range(n)], [[0.0] * width for _ in range(n)]
    index = [[_NO_SAMPLE] * width for _ in range(n)]
    for r, row in enumerate(rows):
        for k, offset in row:
            s = samples[k]
            L = len(s)
            targets[r][offset : offset + L - 1] = s.input_ids[1:]
            loss_mask[r][offset : offset + L - 1] = s.loss_mask[1:]
            logprobs[r][offset : offset + L - 1] = s.rollout_logprobs[1:]
            advantages[r][offset : offset + L] = [float(s.advantage)] * L
            index[r][offset : offset + L] = [members[k]] * L
    return (
        torch.tensor(targets, dtype=torch.long),
        torch.tensor(loss_mask, dtype=torch.bool),
        torch.tensor(logprobs, dtype=torch.float32),
        torch.tensor(advantages, dtype=torch.float32),
        torch.tensor(index, dtype=torch.long),
    )


def _packed(samples, members, resolved, encoder: PromptEncoder, device) -> MicroBatch:
    width = sum(len(s) for s in samples)
    ids = torch.tensor([[t for s in samples for t in s.input_ids]], dtype=torch.long)
    mask = torch.ones_like(ids)
    starts = [0]
    for s in samples:
        starts.append(starts[-1] + len(s))
    inputs = encoder.token_inputs(width, [_placed(samples, starts[:-1])])
    token_keys = list(inputs)
    images = encoder.image_inputs([i for s in samples for i in s.image_ids], device=torch.device(device))
    inputs.update(images)
    positions = []
    for k, s in enumerate(samples):
        segment = slice(starts[k], starts[k + 1])
        seg_inputs = {key: inputs[key][:, segment] for key in token_keys}
        seg_inputs.update(encoder.image_inputs(s.image_ids))
        positions.append(_positions(resolved, ids[:, segment], mask[:, segment], seg_inputs))
    lengths = torch.tensor(starts, dtype=torch.int32)
    longest = torch.tensor(max(len(s) for s in samples))
    inputs.update(
        input_ids=ids,
        position_ids=torch.cat(positions, dim=-1),
        cu_seq_lens_q=lengths,
        cu_seq_lens_k=lengths,
        max_length_q=longest,
        max_length_k=longest,
        **{PACKED_TOKENS: width},
    )
    _with_vision_calls(inputs, resolved, images)
    loss = _loss_tensors(samples, members, [[(k, starts[k]) for k in range(len(samples))]], width)
    return _finish(inputs, loss, members, _sample_tokens(samples, members), device)


def _padded(samples, members, resolved, encoder: PromptEncoder, device) -> MicroBatch:
    width = max(len(s) for s in samples)
    pad = pad_token_id(encoder.tokenizer)
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(samples):
        ids[r, : len(s)] = torch.tensor(s.input_ids)
        mask[r, : len(s)] = 1
    inputs = encoder.token_inputs(width, [_placed([s], [0]) for s in samples])
    if resolved.descriptor.prefix_lm:
        inputs[resolved.descriptor.prefix_lm] = prefix_lm_types(samples, width)
    images = encoder.image_inputs([i for s in samples for i in s.image_ids], device=torch.device(device))
    inputs.update(images)
    inputs.update(input_ids=ids, attention_mask=mask, position_ids=_positions(resolved, ids, mask, inputs))
    _with_vision_calls(inputs, resolved, images)
    loss = _loss_tensors(samples, members, [[(r, 0)] for r in range(len(samples))], width)
    return _finish(inputs, loss, members, _sample_tokens(samples, members), device)


def prefix_lm_types(samples: Sequence[TrainingSample], width: int) -> torch.Tensor:
    """A prefix-LM family's prefix marks (the input its ``prefix_lm`` names) for right-padded rows: 0 over each sample's
    prompt (attended bidirectionally) and padding, 1 from its first generated token on (causal), as the family's
    processor writes a
    ``suffix`` and transformers' ``generate`` marks sampled tokens. The prompt's image spans are 0 too, as the
    processor gives them."""
    types = torch.zeros((len(samples), width), dtype=torch.long)
    for r, s in enumerate(samples):
        start = s.loss_mask.index(True) if any(s.loss_mask) else len(s)
        types[r, start : len(s)] = 1
    return types


def _with_vision_calls(inputs: dict, resolved: ResolvedFamily, images: Mapping[str, object]) -> None:
    """The family's precomputed vision encoder arguments for these images (`vlmreg.modeling.vision_calls`), if any."""
    calls = host_vision_inputs(resolved, images)
    if calls:
        inputs[VISION_CALLS] = calls


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; to a GPU through pinned memory, without waiting: a copy from pageable memory first
    waits for everything queued on the GPU, which would stall the micro-batch built ahead behind the current one."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)  # the pinned block is kept until the copy is done


def _sample_tokens(samples: Sequence[TrainingSample], members: tuple[int, ...]) -> int:
    """The tokens of the step's samples among ``samples`` (a stand-in segment's are none of them)."""
    return sum(len(s) for s, member in zip(samples, members, strict=True) if member != _NO_SAMPLE)


def _finish(inputs, loss, members, tokens, device) -> MicroBatch:
    device = torch.device(device)
    mask, index = loss[1], loss[4]
    selected = mask.flatten().nonzero().squeeze(1)
    samples, sequence = torch.unique(index.flatten()[selected], return_inverse=True)  # sorted: sample order
    selected, sequence = _to(selected, device), _to(sequence, device)
    targets, loss_mask, logprobs, advantages, index = (_to(t, device) for t in loss)
    inputs = {
        k: int(v)
        if k in ("max_length_q", "max_length_k", PACKED_TOKENS)
        else _to(v, device)
        if isinstance(v, torch.Tensor)
        else v
        for k, v in inputs.items()
    }
    if VISION_CALLS in inputs:  # the encoder's arguments, by the input they go with
        inputs[VISION_CALLS] = {
            name: {k: _to(v, device) if isinstance(v, torch.Tensor) else v for k, v in arguments.items()}
            for name, arguments in inputs[VISION_CALLS].items()
        }
    return MicroBatch(
        inputs,
        targets,
        loss_mask,
        logprobs,
        advantages,
        index,
        tuple(m for m in members if m != _NO_SAMPLE),
        tokens,
        selected,
        sequence,
        int(samples.numel()),
    )
