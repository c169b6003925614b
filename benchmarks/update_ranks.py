"""What `policy_update.py` needs beyond one process, and how it counts FLOPs.

Under ``torchrun`` the model is sharded as the trainer shards it (`vlmreg.train.distributed.shard_model`: FSDP2's
``fully_shard`` per decoder layer and vision block, then the root), every rank updates on its own samples, and
ranks that build fewer micro-batches repeat their last one with zero weight (as the trainer does), so every rank
makes the same number of forward and backward passes. Seconds are the slowest rank's, tokens the sum over ranks,
peak memory the largest rank's.

FLOPs per token: 6 x the parameters one token's matmuls use (forward 2, backward 4): attention, norms and routers
and shared experts whole, routed experts at top-k / experts of their parameters, the lm_head; the input embedding
is a lookup and is not counted (unless it is the lm_head's tied weight: then it is counted once, as the lm_head).
For a dense model with tied embeddings (the 2B shape) this is every language-model parameter, the count used before.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from vlmreg.train.distributed import Distributed, from_environment, initialize_from_root, shard_model


def join(device: str) -> Distributed | None:
    """torchrun's process group (NCCL on GPU, gloo on CPU), or ``None`` for one process."""
    return from_environment(device)


def shard(loaded: Any, ctx: Distributed | None, prefetch: int = 0) -> None:
    """FSDP2 over the ranks, as the trainer does it (a no-op for one process); ``prefetch``: explicit prefetching of
    that many decoder layers (`shard_model`)."""
    if ctx is None:
        return
    shard_model(loaded.resolved, ctx, prefetch)
    initialize_from_root(loaded.resolved.model, loaded.processor.tokenizer.eos_token_id, loaded.device)


def even_out(batches: list[Any], ctx: Distributed | None) -> tuple[list[Any], int]:
    """The batches, with the last repeated until every rank has as many as the busiest; and how many repeats."""
    if ctx is None:
        return batches, 0
    idle = ctx.max(len(batches)) - len(batches)
    return batches + [batches[-1]] * idle, idle


def active_matmul_params(loaded: Any) -> tuple[int, int]:
    """(parameters a token's matmuls use, all language-model parameters with the lm_head) -- see the module's
    docstring. Routed experts are the 3-D parameters under an ``experts`` module, scaled by the text config's
    ``num_experts_per_tok / num_experts``."""
    resolved = loaded.resolved
    text = loaded.model.config.get_text_config()
    experts, top_k = getattr(text, "num_experts", None), getattr(text, "num_experts_per_tok", None)
    embedding = resolved.language_model.get_input_embeddings().weight
    head = resolved.lm_head.weight
    active = total = 0
    for name, p in resolved.language_model.named_parameters():
        count = _numel(p)
        total += count
        if p is embedding:
            continue
        if experts and top_k and ".experts." in f".{name}" and p.dim() == 3:
            count = count * top_k // experts
        active += count
    head_count = _numel(head)
    active += head_count
    total += 0 if head is embedding else head_count
    return active, total


def _numel(p: torch.Tensor) -> int:
    """A parameter's whole size (a DTensor's global shape, not its shard)."""
    return int(torch.Size(p.shape).numel())


def reduce(ctx: Distributed | None, seconds: float, tokens: int, peak: float | None) -> tuple[float, int, float | None]:
    """(slowest rank's seconds, tokens over all ranks, largest peak)."""
    if ctx is None:
        return seconds, tokens, peak
    seconds, peak_max = ctx.max_many([seconds, peak or 0.0])
    return seconds, int(ctx.sum([float(tokens)])[0]), (peak_max if peak is not None else None)


def fused(params: list[torch.Tensor], device: str) -> bool:
    """torch's fused AdamW on GPU for plain tensors; its default (foreach) for FSDP2's sharded ones."""
    return device == "cuda" and not any(hasattr(p, "to_local") for p in params)


def experts_in_use(model: torch.nn.Module) -> list[str]:
    """The experts implementations the model's configs name (none for a dense model)."""
    names = {getattr(m.config, "_experts_implementation", None) for m in model.modules() if hasattr(m, "config")}
    return sorted(n for n in names if n)


def release(device: str) -> None:
    """Free what a mode left (sharded modules hold references until collected)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
