"""Per-token logprobs and entropy of the trainer's policy, without full-vocabulary logits for the batch.

The model runs its own forward (so wrappers such as FSDP see a normal call) with ``logits_to_keep`` empty,
so its head computes nothing; the last hidden states are taken from the base model (``model.base_model``,
transformers' name for everything under the head) by a forward hook. Only positions whose next token is
trained are kept, and the resolved ``lm_head`` is applied to them in chunks by a small autograd function
that recomputes the chunk's logits in backward, so at most one chunk of logits exists at a time, in the
forward pass and in the backward pass. Logits a model soft-caps (``final_logit_softcapping`` in its text config) are
capped here as its own head caps them.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.utils.checkpoint import checkpoint

from vlmreg.modeling.attention import packed_rows
from vlmreg.modeling.vision_calls import vision_calls
from vlmreg.resolution import ResolvedFamily

__all__ = ["CHUNK_TOKENS", "hidden_states", "logit_softcap", "selected_logprobs", "token_entropy"]

CHUNK_TOKENS = 4096  # rows of logits the head computes at a time


def hidden_states(resolved: ResolvedFamily, inputs: dict) -> torch.Tensor:
    """Last hidden states (B, L, H) from the model under the head, through the model's own forward."""
    captured: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: object, output: Any) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    model = resolved.model
    handle = model.base_model.register_forward_hook(keep)
    rows = packed_rows() if "cu_seq_lens_q" in inputs else contextlib.nullcontext()
    try:
        nothing = torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device)
        with rows, vision_calls(resolved, inputs) as model_inputs:
            model(**model_inputs, use_cache=False, logits_to_keep=nothing)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected one output from {type(model.base_model).__name__}, got {len(captured)}")
    return captured[0]


class _ChunkLogprob(torch.autograd.Function):
    """log p(target) for one chunk of hidden states, with the head's logits recomputed in backward.

    Forward keeps only the chunk's hidden states, targets and log-sum-exp; backward recomputes the logits once
    and forms the softmax gradient directly, so no full-vocabulary tensor is saved between the passes and none
    is computed twice in the forward. The head's output (in the model's dtype) is taken to fp32 inside the
    reductions; on a GPU those are compiled (`_fused`), so each pass reads the chunk's logits about twice instead of
    writing and reading fp32 copies of them some ten times.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, banned, cap=None):
        z = _capped(torch.nn.functional.linear(hidden, weight, bias), cap)
        logp, entropy, lse = _fused(z, "stats")(z, targets, temperature, banned)
        ctx.save_for_backward(
            hidden,
            weight,
            bias if bias is not None else torch.empty(0),
            targets,
            lse,
            banned if banned is not None else torch.empty(0, dtype=torch.bool),
        )
        ctx.temperature, ctx.has_bias, ctx.has_banned, ctx.cap = temperature, bias is not None, banned is not None, cap
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, banned = ctx.saved_tensors
        grad_logp = grad_logp.clone()  # a view at offset 0 or not would make the compiled pass compile twice
        z = _capped(torch.nn.functional.linear(hidden, weight, bias if ctx.has_bias else None), ctx.cap)
        grad_logits = _fused(z, "grad")(z, lse, targets, grad_logp, ctx.temperature, banned if ctx.has_banned else None)
        if ctx.cap is not None:  # through cap * tanh(x / cap): d/dx = 1 - tanh^2 = 1 - (z / cap)^2
            grad_logits = grad_logits * (1 - (z.float() / ctx.cap) ** 2).to(grad_logits.dtype)
        del z
        grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_logits.transpose(0, 1) @ hidden if ctx.needs_input_grad[1] else None
        grad_bias = grad_logits.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        # one gradient per input given: ``cap`` may have been left to its default
        return (grad_hidden, grad_weight, grad_bias, None, None, None, None)[: len(ctx.needs_input_grad)]


def _capped(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The head's output soft-capped, ``cap * tanh(z / cap)``, as a model whose config sets ``final_logit_softcapping``
    caps its logits; ``z`` itself without a cap."""
    return z if cap is None else torch.tanh(z / cap) * cap


def logit_softcap(model: Any) -> float | None:
    """The ``final_logit_softcapping`` of the model's text config (transformers' name; ``None``: no cap)."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    return float(cap) if cap else None


def _scaled(z: torch.Tensor, temperature: float, banned: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits of the head's output ``z``: divided by the temperature, banned tokens at -inf (``banned``: a bool
    mask over the vocabulary, or the banned ids)."""
    logits = z.float()
    if temperature != 1.0:
        logits = logits / temperature
    if banned is not None:
        fill = logits.masked_fill if banned.dtype == torch.bool else functools.partial(logits.index_fill, -1)
        logits = fill(banned, float("-inf"))
    return logits


def _stats(
    z: torch.Tensor, targets: torch.Tensor, temperature: float, banned: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """(log p(target), entropy, log-sum-exp) of each row of ``z``."""
    logits = _scaled(z, temperature, banned)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    probs = torch.exp(logits - lse.unsqueeze(-1))
    entropy = lse - (probs * logits.masked_fill(torch.isinf(logits), 0.0)).sum(-1)
    return logp, entropy, lse


def _grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor,
    temperature: float,
    banned: torch.Tensor | None,
) -> torch.Tensor:
    """d loss / d z: (onehot(target) - softmax) x grad_logp / temperature, in ``z``'s dtype."""
    grad_logits = torch.exp(_scaled(z, temperature, banned) - lse.unsqueeze(-1)) * -grad_logp.unsqueeze(-1)
    grad_logits = grad_logits.scatter_add(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
    return (grad_logits / temperature).to(z.dtype)


_EAGER: dict[str, Callable[..., Any]] = {"stats": _stats, "grad": _grad}


@functools.cache
def _compiled(kind: str) -> Any:
    return torch.compile(_EAGER[kind], dynamic=True)


def _fused(z: torch.Tensor, kind: str) -> Any:
    """``_stats`` or ``_grad``: compiled on a GPU (``VLMREG_COMPILED_LOGPROBS=0`` keeps them eager), eager elsewhere."""
    if z.is_cuda and os.environ.get("VLMREG_COMPILED_LOGPROBS", "1") != "0":
        return _compiled(kind)
    return _EAGER[kind]


def _entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    suppress: torch.Tensor | None,
    cap: float | None = None,
) -> torch.Tensor:
    logits = _scaled(_capped(torch.nn.functional.linear(hidden, weight, bias), cap), temperature, suppress)
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp.masked_fill(torch.isinf(logp), 0.0)).sum(-1)


def token_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float = 1.0,
    suppress: torch.Tensor | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """H_t = - sum_v p_v log p_v of the head's distribution at each hidden state, with gradient (``cap``: the logits
    soft-capped first, `logit_softcap`).

    The chunk's logits are recomputed in backward (activation checkpointing), so none are kept between the passes.
    """

    return checkpoint(_entropy, hidden, weight, bias, temperature, suppress, cap, use_reentrant=False)


_SUPPRESSED: dict[tuple, torch.Tensor] = {}


def _suppressed(ids: tuple[int, ...], device: torch.device, vocab: int | None = None) -> torch.Tensor | None:
    """The suppressed token ids on ``device`` (or, with ``vocab``, a bool mask over the vocabulary), made once: a copy
    from the host each micro-batch would wait for the GPU."""
    if not ids:
        return None
    key = (tuple(ids), device, vocab)
    if key not in _SUPPRESSED:
        index = torch.tensor(ids, dtype=torch.long, device=device)
        _SUPPRESSED[key] = (
            index if vocab is None else torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, index, True)
        )
    return _SUPPRESSED[key]


def selected_logprobs(
    resolved: ResolvedFamily,
    inputs: dict,
    targets: torch.Tensor,
    select: torch.Tensor,
    *,
    temperature: float = 1.0,
    suppress: tuple[int, ...] = (),
    chunk_tokens: int = CHUNK_TOKENS,
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
    weight, bias = cast(torch.Tensor, head.weight), cast("torch.Tensor | None", head.bias)  # a Linear's (checked above)
    banned, mask = _suppressed(suppress, hidden.device), _suppressed(suppress, hidden.device, weight.shape[0])
    cap = logit_softcap(resolved.model)  # the model's own head caps its logits: so do these
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], wanted[start : start + chunk_tokens]
        logp, entropy = _ChunkLogprob.apply(h, weight, bias, t, temperature, mask, cap)
        if entropy_grad:
            entropy = token_entropy(h, weight, bias, temperature, banned, cap)
        logps.append(logp)
        entropies.append(entropy)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)
