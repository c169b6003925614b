"""Per-token logprobs and entropy of the trainer's policy, without full-vocabulary logits for the batch.

The model runs its own forward (so wrappers such as FSDP see a normal call) with ``logits_to_keep`` empty,
so its head computes nothing; the last hidden states are taken from the base model (``model.base_model``,
transformers' name for everything under the head) by a forward hook. Only positions whose next token is
trained are kept, and the resolved ``lm_head`` is applied to them in chunks, each under activation
checkpointing, so at most one chunk of logits exists at a time, in the forward pass and in the backward pass.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from vlmreg.resolution import ResolvedFamily

__all__ = ["hidden_states", "selected_logprobs"]


def hidden_states(resolved: ResolvedFamily, inputs: dict) -> torch.Tensor:
    """Last hidden states (B, L, H) from the model under the head, through the model's own forward."""
    captured: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: object, output: object) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    model = resolved.model
    handle = model.base_model.register_forward_hook(keep)
    try:
        nothing = torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device)
        model(**inputs, use_cache=False, logits_to_keep=nothing)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected one output from {type(model.base_model).__name__}, got {len(captured)}")
    return captured[0]


def _chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, suppress: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float() / temperature
    if suppress is not None:
        logits = logits.index_fill(-1, suppress, float("-inf"))
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)
    return logp, entropy


def selected_logprobs(
    resolved: ResolvedFamily,
    inputs: dict,
    targets: torch.Tensor,
    select: torch.Tensor,
    *,
    temperature: float = 1.0,
    suppress: tuple[int, ...] = (),
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)`` of ``targets`` at the positions where ``select`` is true, flattened in row order.

    Logprobs carry gradient; entropy is detached. ``temperature`` divides the logits and ``suppress`` token ids
    get no probability, exactly as in the sampler, so trainer and sampler mean the same distribution.
    """
    hidden = hidden_states(resolved, inputs)[select]
    wanted = targets[select]
    head = resolved.lm_head
    banned = torch.tensor(suppress, dtype=torch.long, device=hidden.device) if suppress else None
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], wanted[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            logp, entropy = checkpoint(_chunk, head, h, t, temperature, banned, use_reentrant=False)
        else:
            logp, entropy = _chunk(head, h, t, temperature, banned)
        logps.append(logp)
        entropies.append(entropy.detach())
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)
