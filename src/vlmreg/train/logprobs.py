"""Per-token logprobs and entropy of the trainer's policy, without full-vocabulary logits for the batch.

The model runs its own forward (so wrappers such as FSDP see a normal call) with ``logits_to_keep`` empty,
so its head computes nothing; the last hidden states are taken from the base model (``model.base_model``,
transformers' name for everything under the head) by a forward hook. Only positions whose next token is
trained are kept, and the resolved ``lm_head`` is applied to them in chunks by a small autograd function
that recomputes the chunk's logits in backward, so at most one chunk of logits exists at a time, in the
forward pass and in the backward pass.
"""

from __future__ import annotations

import contextlib

import torch

from vlmreg.resolution import ResolvedFamily
from vlmreg.train.attention import packed_rows

__all__ = ["hidden_states", "selected_logprobs", "token_entropy"]


def hidden_states(resolved: ResolvedFamily, inputs: dict) -> torch.Tensor:
    """Last hidden states (B, L, H) from the model under the head, through the model's own forward."""
    captured: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: object, output: object) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    model = resolved.model
    handle = model.base_model.register_forward_hook(keep)
    rows = packed_rows() if "cu_seq_lens_q" in inputs else contextlib.nullcontext()
    try:
        nothing = torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device)
        with rows:
            model(**inputs, use_cache=False, logits_to_keep=nothing)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected one output from {type(model.base_model).__name__}, got {len(captured)}")
    return captured[0]


class _ChunkLogprob(torch.autograd.Function):
    """log p(target) for one chunk of hidden states, with the head's logits recomputed in backward.

    Forward keeps only the chunk's hidden states, targets and log-sum-exp; backward recomputes the logits once
    and forms the softmax gradient directly, so no full-vocabulary tensor is saved between the passes and none
    is computed twice in the forward. Logits are handled in fp32 whatever the model's dtype.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, suppress):  # type: ignore[override]
        logits = _logits(hidden, weight, bias, temperature, suppress)
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        probs = torch.exp(logits - lse.unsqueeze(-1))
        entropy = lse - (probs * logits.masked_fill(torch.isinf(logits), 0.0)).sum(-1)
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), targets, lse, suppress if suppress is not None else torch.empty(0, dtype=torch.long))
        ctx.temperature, ctx.has_bias, ctx.has_suppress = temperature, bias is not None, suppress is not None
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):  # type: ignore[override]
        hidden, weight, bias, targets, lse, suppress = ctx.saved_tensors
        logits = _logits(hidden, weight, bias if ctx.has_bias else None, ctx.temperature, suppress if ctx.has_suppress else None)
        # d logp / d logits = onehot(target) - softmax(logits), times d logits / d z = 1 / temperature
        grad_logits = torch.exp(logits - lse.unsqueeze(-1)).mul_(-grad_logp.unsqueeze(-1))
        grad_logits.scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
        grad_logits = (grad_logits / ctx.temperature).to(hidden.dtype)
        grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_logits.transpose(0, 1) @ hidden if ctx.needs_input_grad[1] else None
        grad_bias = grad_logits.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float, suppress: torch.Tensor | None) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    if suppress is not None:
        logits = logits.index_fill(-1, suppress, float("-inf"))
    return logits


def _entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float, suppress: torch.Tensor | None) -> torch.Tensor:
    logits = _logits(hidden, weight, bias, temperature, suppress)
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp.masked_fill(torch.isinf(logp), 0.0)).sum(-1)


def token_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float = 1.0, suppress: torch.Tensor | None = None
) -> torch.Tensor:
    """H_t = - sum_v p_v log p_v of the head's distribution at each hidden state, with gradient.

    The chunk's logits are recomputed in backward (activation checkpointing), so none are kept between the passes.
    """
    from torch.utils.checkpoint import checkpoint

    return checkpoint(_entropy, hidden, weight, bias, temperature, suppress, use_reentrant=False)


_SUPPRESSED: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _suppressed(ids: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """The suppressed token ids on ``device``, made once (a copy from the host each micro-batch would wait for the GPU)."""
    if not ids:
        return None
    key = (tuple(ids), device)
    if key not in _SUPPRESSED:
        _SUPPRESSED[key] = torch.tensor(ids, dtype=torch.long, device=device)
    return _SUPPRESSED[key]


def selected_logprobs(
    resolved: ResolvedFamily,
    inputs: dict,
    targets: torch.Tensor,
    select: torch.Tensor,
    *,
    temperature: float = 1.0,
    suppress: tuple[int, ...] = (),
    chunk_tokens: int = 4096,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)`` of ``targets`` at the positions where ``select`` is true, flattened in row order.

    ``select`` is a (B, L) bool mask, or the flat row-major positions it marks (a long tensor, as
    `MicroBatch.selected`): then nothing here waits for the GPU, so the host can queue the next micro-batch.
    Logprobs carry gradient; entropy is detached unless ``entropy_grad`` (for an entropy bonus: then it is computed
    a second time, by `token_entropy`). ``temperature`` divides the logits and ``suppress`` token ids get no
    probability, exactly as in the sampler, so trainer and sampler mean the same distribution.
    """
    head = resolved.lm_head
    if not isinstance(head, torch.nn.Linear) and type(head).__name__ != "Linear":
        raise TypeError(f"the resolved lm_head is a {type(head).__name__}; chunked logprobs need a linear head")
    states = hidden_states(resolved, inputs)
    if select.dtype == torch.bool:
        hidden, wanted = states[select], targets[select]
    else:
        hidden, wanted = states.flatten(0, 1).index_select(0, select), targets.flatten().index_select(0, select)
    banned = _suppressed(suppress, hidden.device)
    weight, bias = head.weight, head.bias
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], wanted[start : start + chunk_tokens]
        logp, entropy = _ChunkLogprob.apply(h, weight, bias, t, temperature, banned)
        if entropy_grad:
            entropy = token_entropy(h, weight, bias, temperature, banned)
        logps.append(logp)
        entropies.append(entropy)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)
