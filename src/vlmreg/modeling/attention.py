"""Block-diagonal attention for packed rows: ``attn_implementation = "varlen"`` (the default).

With ``sdpa`` a packed row gets a dense (L x L) mask and the kernel computes every block, masked or not,
so a long row of many samples costs many times the attention it needs. Here each segment attends only to
itself, given the ``cu_seq_lens`` the trainer passes with every packed micro-batch: on CUDA through
PyTorch's variable-length attention (``torch.nn.attention.varlen``), elsewhere one causal ``sdpa`` call per
segment (also on CUDA in fp32, which FlashAttention does not take). A layer with a sliding window
(``sliding_window`` passed by the layer, or set on the module) attends within its window in each segment,
exactly as transformers' own mask does (key within the last ``window`` positions, itself included).
Attention a packed row cannot express (bidirectional blocks over images) is the family's to declare
(``packing=False``), and then no packed row reaches this function. Registered into transformers' attention
interface as ``vlmreg_varlen``; calls without ``cu_seq_lens_q`` (generation, padded batches) go to ``sdpa``
with its mask, unchanged.

The vision encoder gets ``vlmreg_flash_varlen`` (`use_varlen_vision`): the same kernel, non-causal, over the
encoder's own image segments. transformers' vision towers that pack their images into one sequence give an attention
implementation whose name contains "flash" the segment table of all images in one call, where they otherwise call
attention once per image (64 images x 24 blocks = 1,536 calls a step, each after reading the table back from the
GPU). The text's packing arguments are kept off the encoder (transformers hands the model's keyword arguments down
to it), so the segments it sees are its own; towers that pass no segments get ``sdpa``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "PACKED_TOKENS",
    "VARLEN",
    "VISION_VARLEN",
    "packed_rows",
    "register_varlen_attention",
    "softcapped_attention",
    "use_varlen_vision",
    "varlen_attention_forward",
    "vision_attention_forward",
]

VARLEN = "vlmreg_varlen"
#: The vision encoder's implementation: "flash" in the name makes transformers' packing vision towers pass every
#: image's segment in one call.
VISION_VARLEN = "vlmreg_flash_varlen"
#: Model input naming how many tokens a packed micro-batch's rows hold (a host int, beside ``cu_seq_lens_q``).
PACKED_TOKENS = "vlmreg_packed_tokens"


@functools.cache
def _varlen() -> tuple[Any, frozenset[str]]:
    """PyTorch's varlen attention and the names of its parameters (looked up once), or ``(None, {})``."""
    try:
        # deferred: optional, its absence is handled here
        from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query`` (B, H, L, D) -> output (B, L, H, D)."""
    lengths = kwargs.get("cu_seq_lens_q")
    batch, heads, length, dim = query.shape
    # the segments must cover exactly these rows (a vision tower's per-image calls may be handed the text's segments):
    # the trainer says how many tokens its packed rows hold, so nothing is read back from the GPU
    total = kwargs.get(PACKED_TOKENS)
    if total is None and lengths is not None:
        total = int(lengths[-1])
    softcap = kwargs.get("softcap")
    if softcap is not None and lengths is not None and total == batch * length:
        raise ValueError(
            f"{type(module).__name__}: attention logits soft-capped at {softcap} in a packed row: vlmreg's "
            "packed attention does not soft-cap; declare the family packing=False"
        )
    if softcap is not None:  # sdpa cannot soft-cap: transformers refuses sdpa for such models
        return softcapped_attention(module, query, key, value, attention_mask, float(softcap), dropout, scaling)
    if lengths is None or kwargs.get("cache") is not None or total != batch * length:
        # deferred: start-up cost (loads transformers)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    window = int(window) if window else None
    # rows flattened
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    # PyTorch's varlen kernel is FlashAttention: CUDA, fp16 / bf16 only
    attend, parameters = (
        _varlen() if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else (None, frozenset())
    )
    if attend is None or (window is not None and "window_size" not in parameters):
        out = _per_segment(q, k, v, lengths.tolist(), causal, scaling, window)
        return out.reshape(batch, length, heads, dim), None
    lengths = lengths.to(device=q.device, dtype=torch.int32)
    longest = int(kwargs.get("max_length_q") or int((lengths[1:] - lengths[:-1]).max()))
    options: dict[str, Any] = {"scale": scaling}
    if "window_size" in parameters:
        left = window - 1 if window is not None else -1
        options["window_size"] = (left, 0) if causal else (left, left if window is not None else -1)
    else:
        options["is_causal"] = causal
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = attend(q.contiguous(), k.contiguous(), v.contiguous(), lengths, lengths, longest, longest, **options)
    return out.reshape(batch, length, heads, dim), None


def softcapped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    softcap: float,
    dropout: float = 0.0,
    scaling: float | None = None,
) -> tuple[torch.Tensor, None]:
    """Attention whose logits are soft-capped, ``softcap * tanh(s / softcap)`` (as the text config's
    ``attn_logit_softcapping`` asks), written out:
    sdpa has no soft-capping. ``mask`` is sdpa's (boolean, True where a query may attend) or an additive one; ``None``
    means causal unless the module is not. Output (B, L, H, D), as the other attention functions."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    queries, keys = scores.shape[-2], scores.shape[-1]
    if mask is None and queries > 1 and getattr(module, "is_causal", True):
        mask = torch.ones((queries, keys), dtype=torch.bool, device=scores.device).tril(keys - queries)
    if mask is not None:
        mask = mask[..., :keys]
        lowest = torch.finfo(scores.dtype).min  # not -inf: a row with nothing to attend (padding) stays finite
        scores = scores.masked_fill(~mask, lowest) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout and module.training:
        weights = F.dropout(weights, p=dropout)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


def vision_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A vision encoder's attention: its own image segments (``cu_seq_lens_q``, which `use_varlen_vision` makes sure
    are the encoder's, never the text's) in one varlen call; without segments, ``sdpa`` with the encoder's mask."""
    if kwargs.get("cu_seq_lens_q") is None:
        # deferred: start-up cost (loads transformers)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # the encoder's own table covers its rows: nothing to read back
    kwargs[PACKED_TOKENS] = query.shape[0] * query.shape[2]
    return varlen_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


#: The text's packing arguments, which must not reach a vision encoder (its attention would take them for its own).
TEXT_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", PACKED_TOKENS)


def _without_text_packing(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, {k: v for k, v in kwargs.items() if k not in TEXT_PACKING_KEYS}


#: The vision encoders that already drop the text's packing arguments (`use_varlen_vision` hooks each once).
_TEXT_PACKING_OFF: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def use_varlen_vision(vision_encoder: torch.nn.Module) -> bool:
    """Give ``vision_encoder`` (a resolved family's) `VISION_VARLEN` and keep the text's packing arguments off it;
    idempotent. ``False`` when the encoder has no transformers config to set (it keeps its attention)."""
    config = getattr(vision_encoder, "config", None)
    if config is None or not hasattr(config, "_attn_implementation_internal"):
        return False
    register_varlen_attention()
    config._attn_implementation_internal = VISION_VARLEN
    if vision_encoder not in _TEXT_PACKING_OFF:
        vision_encoder.register_forward_pre_hook(_without_text_packing, with_kwargs=True)
        _TEXT_PACKING_OFF.add(vision_encoder)
    return True


def _per_segment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: list[int],
    causal: bool,
    scale: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """Exact block-diagonal attention as one ``sdpa`` call per segment; ``q`` (N, H, D) -> (N, H, D)."""

    repeat = q.shape[1] // k.shape[1]
    out = []
    for a, b in itertools.pairwise(bounds):
        qs, ks, vs = q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
        if repeat > 1:
            ks, vs = ks.repeat_interleave(repeat, dim=0), vs.repeat_interleave(repeat, dim=0)
        if window is None:
            out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale).transpose(0, 1))
            continue
        position = torch.arange(b - a, device=q.device)
        distance = position[:, None] - position[None, :]
        allowed = (distance.abs() < window) & ((distance >= 0) if causal else True)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale).transpose(0, 1))
    return torch.cat(out, dim=0)


def register_varlen_attention() -> str:
    """Register ``vlmreg_varlen`` with transformers (idempotent) and return its name."""
    # deferred: start-up cost (loads transformers)
    from transformers import AttentionInterface  # noqa: PLC0415
    from transformers.masking_utils import AttentionMaskInterface  # noqa: PLC0415

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, _mask)
    AttentionInterface.register(VISION_VARLEN, vision_attention_forward)
    AttentionMaskInterface.register(VISION_VARLEN, _mask)
    return VARLEN


_PACKED: contextvars.ContextVar[bool] = contextvars.ContextVar("vlmreg_packed_rows", default=False)


@contextlib.contextmanager
def packed_rows() -> Iterator[None]:
    """Within this block, forwards are of packed rows: no dense mask is built (segments come as ``cu_seq_lens``)."""
    token = _PACKED.set(True)
    try:
        yield
    finally:
        _PACKED.reset(token)


def _mask(*args: Any, **kwargs: Any) -> Any:
    """sdpa's mask (causal, padding, sliding windows, the family's own mask functions), except for packed rows.

    A packed row's segments come as ``cu_seq_lens`` and each attends only to itself, so building its dense
    (L x L) mask would only cost memory; every other call (generation, padded batches, a plain forward)
    gets exactly the mask transformers' sdpa gets.
    """
    # deferred: start-up cost (loads transformers)
    from transformers.masking_utils import sdpa_mask  # noqa: PLC0415

    if _PACKED.get():
        return None
    return sdpa_mask(*args, **kwargs)
