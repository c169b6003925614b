"""`Objective`: a policy-gradient loss registered by name through ``vlmreg_register_objectives``.

``[trainer] algorithm`` names one. The loss function receives a `LossInputs` for one
micro-batch (the policy's token logprobs with gradient, the old and rollout logprobs, advantages, importance
weights, the whole step's counts, and the loss aggregation the run chose) and returns ``(loss, clipped)``: a scalar
already normalised so that summing it over the step's micro-batches gives the step's loss (the normalisation lives
with the formula), and a per-token bool tensor saying which tokens the objective clipped.

An objective that declares an ``aggregation`` computes per-token terms and reduces them with `aggregate`, so
``[trainer] loss_aggregation`` can change how; one that declares none normalises its loss itself, and
``loss_aggregation`` is refused for it. The formulas are in `vlmreg.train.losses`. Nothing here imports torch:
`aggregate` uses only the tensors' own methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from vlmreg.sdk.field_checks import check_callable, check_name, field_error

if TYPE_CHECKING:
    import torch

__all__ = ["AGGREGATIONS", "TIS_LEVELS", "LossInputs", "Objective", "aggregate", "count_sequences", "sequence_lengths"]

#: How per-token loss terms become the step's loss (the names verl's ``loss_agg_mode`` uses), over the step's
#: samples i with |y_i| loss tokens each: ``token-mean`` sum_i sum_t / sum_i |y_i| (DAPO); ``seq-mean-token-mean``
#: mean_i (sum_t / |y_i|) (DeepSeekMath's GRPO, GSPO, SAPO); ``seq-mean-token-sum`` mean_i sum_t;
#: ``seq-mean-token-sum-norm`` mean_i sum_t / max_tokens, a constant (Dr. GRPO).
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: The levels of the truncated importance weight (`vlmreg.train.losses.tis_weights`).
TIS_LEVELS = ("token", "sequence", "geometric")


def _check_clip(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    ok = (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    )
    if not ok or not 0 < value[0] <= 1 or not value[1] > 0:
        raise field_error(
            instance, attribute, "must be (clip_low in (0, 1], clip_high > 0); clip_low = 1: no lower bound", value
        )


def _one_of(choices: tuple[str, ...], *, optional: bool = False):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if optional and value is None:
            return
        if value not in choices:
            allowed = ", ".join(repr(c) for c in choices) + (" or None" if optional else "")
            raise field_error(instance, attribute, f"must be one of {allowed}", value)

    return check


@attrs.frozen(kw_only=True, eq=False)
class Objective:
    """A loss: ``loss(inputs) -> (loss, clipped)``; ``clip`` the default ``(clip_low, clip_high)`` of its ratio;
    ``aggregation`` the default reduction of its per-token terms (None: it normalises itself); ``tis_level`` the
    default level of its importance weights."""

    name: str = attrs.field(validator=check_name)
    loss: Callable[[Any], tuple[Any, Any]] = attrs.field(
        validator=check_callable(optional=False, what="a callable taking LossInputs")
    )
    clip: tuple[float, float] = attrs.field(
        default=(0.2, 0.28), converter=lambda v: tuple(v) if isinstance(v, list | tuple) else v, validator=_check_clip
    )
    aggregation: str | None = attrs.field(default=None, validator=_one_of(AGGREGATIONS, optional=True))
    tis_level: str = attrs.field(default="token", validator=_one_of(TIS_LEVELS))
    description: str = ""


@attrs.frozen
class LossInputs:
    """One micro-batch's loss tokens (flat) and the whole step's counts, for an objective."""

    logp: torch.Tensor  # log pi_theta, with gradient
    logp_old: torch.Tensor  # the trainer's policy before this update (no gradient)
    logp_rollout: torch.Tensor  # what the rollout engine sampled from
    advantages: torch.Tensor  # A_i for each token's sample
    weights: torch.Tensor  # TIS weights w_t (ones without TIS)
    sequence: torch.Tensor  # each token's sample, 0..n-1 within the micro-batch
    clip_low: float
    clip_high: float
    total_tokens: int  # loss tokens in the whole step (over every rank)
    num_samples: int  # samples in the whole step (over every rank)
    max_tokens: int  # the longest completion a rollout may sample
    num_sequences: int | None = None  # n: distinct values of ``sequence`` (None: read off ``sequence``, a device sync)
    # how `aggregate` reduces per-token terms (one of AGGREGATIONS; None: the objective's own)
    aggregation: str | None = None

    @property
    def sequences(self) -> int:
        """n, the micro-batch's samples (``sequence`` runs 0..n-1)."""
        return count_sequences(self.sequence, self.num_sequences)


def count_sequences(sequence: torch.Tensor, num_sequences: int | None) -> int:
    """n, the number of sequences (``num_sequences`` when the caller knows it: reading it off the device waits for
    it)."""
    if num_sequences is not None:
        return num_sequences
    return int(sequence.max()) + 1 if sequence.numel() else 0


def sequence_lengths(sequence: torch.Tensor, n: int, like: torch.Tensor) -> torch.Tensor:
    """|y_i|: each of the n samples' loss tokens, in ``like``'s dtype and device."""
    return like.new_zeros(n).index_add_(0, sequence, like.new_ones(like.shape))


def aggregate(terms: torch.Tensor, x: LossInputs) -> torch.Tensor:
    """This micro-batch's share of the step's loss from per-token ``terms`` (flat, like ``x.logp``), reduced as
    ``x.aggregation`` says over the whole step, over its n samples with |y_i| loss tokens each (N = sum_i |y_i|,
    M = ``x.max_tokens``): ``token-mean`` sum_i sum_t l_t / N; ``seq-mean-token-mean`` mean_i (sum_t l_t / |y_i|);
    ``seq-mean-token-sum`` mean_i sum_t l_t; ``seq-mean-token-sum-norm`` mean_i sum_t l_t / M. A sample's tokens are
    all in one micro-batch, so the shares of the step's micro-batches add up to the step's loss."""
    mode = x.aggregation
    if mode == "token-mean":
        return terms.sum() / max(x.total_tokens, 1)
    if mode == "seq-mean-token-mean":
        return (terms / sequence_lengths(x.sequence, x.sequences, terms)[x.sequence]).sum() / max(x.num_samples, 1)
    if mode == "seq-mean-token-sum":
        return terms.sum() / max(x.num_samples, 1)
    if mode == "seq-mean-token-sum-norm":
        return terms.sum() / max(x.num_samples * x.max_tokens, 1)
    raise ValueError(f"loss aggregation {mode!r} is not one of {', '.join(AGGREGATIONS)}")
