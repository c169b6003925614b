"""Micro-batches by token budget, packed (segments in one row, positions restart per segment) or padded.

Positions come from the family: a descriptor's ``position_ids`` provider (3-D M-RoPE, say)
is called per segment, so a packed row carries exactly the positions each sample would have alone. Without
a provider, positions are ``0..n-1`` per segment, from which transformers builds a block-diagonal mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from vlmreg.data.prompts import image_token_id
from vlmreg.data.store import ImageStore, pad_token_id
from vlmreg.data.truncation import check_image_tokens
from vlmreg.resolution import ResolvedFamily
from vlmreg.train.samples import TrainingSample

__all__ = ["MicroBatch", "make_microbatches", "plan_microbatches"]


@attrs.frozen(eq=False)
class MicroBatch:
    """Model inputs plus, per token position, what the loss needs (shifted: position t predicts token t+1)."""

    inputs: dict[str, torch.Tensor]
    targets: torch.Tensor  # (B, L) next token
    loss_mask: torch.Tensor  # (B, L) bool: targets that are generated tokens
    rollout_logprobs: torch.Tensor  # (B, L)
    advantages: torch.Tensor  # (B, L)
    sample_index: torch.Tensor  # (B, L) index into the step's samples (-1 where no sample)
    samples: tuple[int, ...]
    tokens: int  # real (non-pad) tokens


def plan_microbatches(lengths: Sequence[int], budget: int, *, packed: bool) -> list[list[int]]:
    """Group sample indices so each micro-batch fits ``budget`` tokens (padded width x rows when not packed).

    First-fit decreasing: long samples first, each into the first micro-batch with room.
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
    return [sorted(members) for members in bins]


def _positions(resolved: ResolvedFamily, ids: torch.Tensor, mask: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
    provider = resolved.descriptor.position_ids
    if provider is not None:
        return provider(resolved.model, {"input_ids": ids, "attention_mask": mask, **extra})
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _image_inputs(samples: Sequence[TrainingSample], processor: Any, store: ImageStore, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    extra = store.batch_features([i for s in samples for i in s.image_ids], processor)
    if "mm_token_type_ids" in getattr(processor, "model_input_names", ()):
        extra["mm_token_type_ids"] = (ids == image_token_id(processor)).long() * mask
    return extra


def make_microbatches(
    samples: Sequence[TrainingSample],
    resolved: ResolvedFamily,
    processor: Any,
    store: ImageStore,
    *,
    budget: int,
    packed: bool,
    device: torch.device,
) -> list[MicroBatch]:
    """Build every micro-batch of a step; the image-token invariant is checked on each before it is returned."""
    plan = plan_microbatches([len(s) for s in samples], budget, packed=packed)
    build = _packed if packed else _padded
    image_token = image_token_id(processor)
    batches = []
    for members in plan:
        chosen = [samples[i] for i in members]
        for s in chosen:
            check_image_tokens(s.input_ids, image_token, s.image_tokens, s.example_id)
        batches.append(build(chosen, tuple(members), resolved, processor, store, device))
    return batches


def _loss_tensors(samples: Sequence[TrainingSample], members: tuple[int, ...], rows: list[list[tuple[int, int]]], width: int):
    """Shifted per-position targets/mask/logprobs/advantages; ``rows`` lists (sample, offset) per row."""
    n = len(rows)
    targets = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.bool)
    logprobs = torch.zeros((n, width))
    advantages = torch.zeros((n, width))
    index = torch.full((n, width), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        for k, offset in row:
            s = samples[k]
            L = len(s)
            targets[r, offset : offset + L - 1] = torch.tensor(s.input_ids[1:])
            loss_mask[r, offset : offset + L - 1] = torch.tensor(s.loss_mask[1:])
            logprobs[r, offset : offset + L - 1] = torch.tensor(s.rollout_logprobs[1:])
            advantages[r, offset : offset + L] = s.advantage
            index[r, offset : offset + L] = members[k]
    return targets, loss_mask, logprobs, advantages, index


def _packed(samples, members, resolved, processor, store, device) -> MicroBatch:
    width = sum(len(s) for s in samples)
    ids = torch.tensor([[t for s in samples for t in s.input_ids]], dtype=torch.long)
    mask = torch.ones_like(ids)
    inputs = _image_inputs(samples, processor, store, ids, mask)
    positions, offset, offsets = [], 0, []
    for s in samples:
        segment = slice(offset, offset + len(s))
        seg_inputs = {k: v[:, segment] for k, v in inputs.items() if k == "mm_token_type_ids"}
        seg_inputs.update(store.batch_features(s.image_ids, processor))
        positions.append(_positions(resolved, ids[:, segment], mask[:, segment], seg_inputs))
        offsets.append((len(offsets), offset))
        offset += len(s)
    lengths = torch.tensor([0] + [len(s) for s in samples]).cumsum(0).to(torch.int32)
    inputs.update(
        input_ids=ids,
        position_ids=torch.cat(positions, dim=-1),
        cu_seq_lens_q=lengths,
        cu_seq_lens_k=lengths,
        max_length_q=torch.tensor(max(len(s) for s in samples)),
        max_length_k=torch.tensor(max(len(s) for s in samples)),
    )
    loss = _loss_tensors(samples, members, [offsets], width)
    return _finish(inputs, loss, members, width, device)


def _padded(samples, members, resolved, processor, store, device) -> MicroBatch:
    width = max(len(s) for s in samples)
    pad = pad_token_id(processor.tokenizer)
    ids = torch.full((len(samples), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(samples):
        ids[r, : len(s)] = torch.tensor(s.input_ids)
        mask[r, : len(s)] = 1
    inputs = _image_inputs(samples, processor, store, ids, mask)
    inputs.update(input_ids=ids, attention_mask=mask, position_ids=_positions(resolved, ids, mask, inputs))
    loss = _loss_tensors(samples, members, [[(r, 0)] for r in range(len(samples))], width)
    return _finish(inputs, loss, members, sum(len(s) for s in samples), device)


def _finish(inputs, loss, members, tokens, device) -> MicroBatch:
    targets, loss_mask, logprobs, advantages, index = (t.to(device) for t in loss)
    inputs = {k: v.to(device) if k not in ("max_length_q", "max_length_k") else int(v) for k, v in inputs.items()}
    return MicroBatch(inputs, targets, loss_mask, logprobs, advantages, index, members, tokens)
