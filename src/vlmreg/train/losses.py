"""The objectives, each written once, next to its formula.

Notation, per generated token t of sample i (all tensors are flat over the batch's loss tokens):
  logp        log pi_theta(y_t | ...)            the policy being trained (carries gradient)
  logp_old    log pi_theta_old(y_t | ...)        the trainer's policy before this update (no gradient)
  logp_rollout log pi_rollout(y_t | ...)         what the rollout engine sampled from
  A_i         the sample's advantage

GRPO (Shao et al. 2024, DeepSeekMath; decoupled clip of DAPO, Yu et al. 2025):
  r_t = exp(logp - logp_old)
  L   = - sum_t w_t * min(r_t * A_i, clip(r_t, 1 - eps_low, 1 + eps_high) * A_i) / (number of loss tokens)
GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of the token ratios,
  s_i = exp(mean_t(logp - logp_old)),  in token form s_it = sg(s_i) * exp(logp - sg(logp))
  L   = - mean_i mean_t w_t * min(s_it * A_i, clip(s_it, 1 - eps_low, 1 + eps_high) * A_i)
TIS (truncated importance sampling, Yao et al. 2025): a detached weight correcting for the rollout engine's
distribution differing from the trainer's (another engine's numerics, or an older policy when rollouts run ahead
of training), from the ratio rho = pi_theta_old / pi_rollout at one of three levels ([trainer] tis_level),
  token:      rho_t = exp(logp_old_t - logp_rollout_t)
  sequence:   rho_i = exp(sum_t (logp_old_t - logp_rollout_t))     every token of sample i gets rho_i
  geometric:  rho_i = exp(mean_t (logp_old_t - logp_rollout_t))
and one of two modes ([trainer] tis_mode):
  truncate:   w = min(rho, C)
  mask:       w = rho if rho <= C, else 0   (masked importance sampling: such tokens or samples get no loss)
Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO's per-token surrogate without its length
bias, normalised by a constant instead of the batch's token count (use it with normalize_advantage_std = false),
  L   = - sum_t w_t * min(r_t * A_i, clip(r_t, ...) * A_i) / (number of samples * max_tokens)
CISPO (MiniMax-M1, 2025): the importance ratio itself is clipped and detached, so clipped tokens keep their gradient,
  L   = - sum_t w_t * sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_i * logp_t / (number of loss tokens)
SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): a smooth gate instead of the hard clip, with a
temperature tau (tau_pos = 1.0 for A > 0, tau_neg = 1.05 for A < 0, the paper's values),
  f(r) = sigmoid(tau (r - 1)) * 4 / tau          (f'(1) = 1: on-policy, the plain policy gradient)
  L    = - mean_i mean_t w_t * f(r_t) * A_i      (like GSPO, a token mean per sequence, then a mean over sequences)
  the gradient weight f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1)), fades as r leaves 1; tokens where it is below
  1/2 are reported as clipped
KL to a reference policy, the k3 estimator (Schulman 2020), for samples drawn from p:
  KL(p || q) ~ exp(logq - logp) - (logq - logp) - 1

Each objective takes a `LossInputs` for one micro-batch and returns (loss, clipped): the loss is already divided by
the whole step's normaliser, so the micro-batches' losses add up to the step's.
"""

from __future__ import annotations

import math

import attrs
import torch

__all__ = ["LossInputs", "cispo", "dr_grpo", "sapo", "group_advantages", "grpo", "grpo_loss", "gspo", "gspo_loss", "k3", "tis_weights"]


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean of its group) / (std of its group + eps); without ``normalize_std``, only the mean is removed."""
    advantages = torch.empty_like(rewards, dtype=torch.float32)
    for group in groups.unique():
        members = groups == group
        r = rewards[members].float()
        centered = r - r.mean()
        advantages[members] = centered / (r.std(unbiased=False) + eps) if normalize_std else centered
    return advantages


def _count(sequence: torch.Tensor, num_sequences: int | None) -> int:
    """n, the number of sequences (``num_sequences`` when the caller knows it: reading it off the device waits for it)."""
    if num_sequences is not None:
        return num_sequences
    return int(sequence.max()) + 1 if sequence.numel() else 0


def tis_weights(
    logp_old: torch.Tensor, logp_rollout: torch.Tensor, cap: float, *, sequence: torch.Tensor | None = None,
    level: str = "token", mode: str = "truncate", num_sequences: int | None = None,
) -> torch.Tensor:
    """The importance weights w (detached, one per token) of the formulas above; ``sequence`` maps each token to its
    sample (0..n-1), needed for the sequence and geometric levels (``num_sequences``: n, when known)."""
    log_ratio = (logp_old - logp_rollout).detach().float()
    if level != "token":
        if sequence is None:
            raise ValueError(f"tis level {level!r} needs each token's sequence")
        n = _count(sequence, num_sequences)
        sums = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(0, sequence, log_ratio)
        if level == "geometric":
            counts = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(0, sequence, torch.ones_like(log_ratio))
            sums = sums / counts.clamp(min=1)
        elif level != "sequence":
            raise ValueError(f"unknown tis level {level!r}")
        log_ratio = sums[sequence]
    log_cap = math.log(cap)
    if mode == "truncate":
        weights = torch.exp(log_ratio.clamp(max=log_cap))
    elif mode == "mask":
        weights = torch.where(log_ratio <= log_cap, torch.exp(log_ratio.clamp(max=log_cap)), torch.zeros_like(log_ratio))
    else:
        raise ValueError(f"unknown tis mode {mode!r}")
    return weights.to(logp_old.dtype)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def grpo_loss(
    logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token GRPO loss terms (sum them and divide by the batch's loss tokens) and which tokens were clipped."""
    ratio = torch.exp(logp - logp_old)
    surrogate, clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    return -weights * surrogate, clipped


def gspo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    sequence: torch.Tensor,
    clip_low: float,
    clip_high: float,
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token GSPO loss terms already divided by their sequence's length (sum them, divide by the number of
    sequences) and which tokens were clipped. ``sequence`` maps each token to its sample index (0..n-1)."""
    n = _count(sequence, num_sequences)
    lengths = torch.zeros(n, dtype=logp.dtype, device=logp.device).index_add_(0, sequence, torch.ones_like(logp))
    log_ratio = (logp - logp_old).detach()
    mean_log_ratio = torch.zeros(n, dtype=logp.dtype, device=logp.device).index_add_(0, sequence, log_ratio) / lengths
    s = torch.exp(mean_log_ratio)[sequence] * torch.exp(logp - logp.detach())
    surrogate, clipped = _clipped_surrogate(s, advantages, clip_low, clip_high)
    return -weights * surrogate / lengths[sequence], clipped


def k3(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Per-sample estimate of KL(p || q) for tokens sampled from p: exp(logq - logp) - (logq - logp) - 1 (>= 0)."""
    delta = logq - logp
    return (torch.exp(delta) - delta - 1).clamp(min=0.0)  # >= 0 exactly; rounding can dip below


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

    @property
    def sequences(self) -> int:
        """n, the micro-batch's samples (``sequence`` runs 0..n-1)."""
        return _count(self.sequence, self.num_sequences)


def grpo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    terms, clipped = grpo_loss(x.logp, x.logp_old, x.advantages, x.weights, x.clip_low, x.clip_high)
    return terms.sum() / max(x.total_tokens, 1), clipped


def gspo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    terms, clipped = gspo_loss(x.logp, x.logp_old, x.advantages, x.weights, x.sequence, x.clip_low, x.clip_high, x.num_sequences)
    return terms.sum() / max(x.num_samples, 1), clipped


def dr_grpo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    terms, clipped = grpo_loss(x.logp, x.logp_old, x.advantages, x.weights, x.clip_low, x.clip_high)
    return terms.sum() / max(x.num_samples * x.max_tokens, 1), clipped


def cispo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = torch.exp(x.logp - x.logp_old).detach()
    kept = ratio.clamp(1 - x.clip_low, 1 + x.clip_high)
    terms = -x.weights * kept * x.advantages * x.logp
    return terms.sum() / max(x.total_tokens, 1), kept != ratio


SAPO_TAU_POSITIVE, SAPO_TAU_NEGATIVE = 1.0, 1.05


def sapo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = torch.exp(x.logp - x.logp_old)
    tau = torch.full_like(ratio, SAPO_TAU_NEGATIVE).masked_fill(x.advantages > 0, SAPO_TAU_POSITIVE).detach()
    gate = torch.sigmoid(tau * (ratio - 1))
    terms = -x.weights * gate * 4 / tau * x.advantages
    lengths = torch.zeros(x.sequences, dtype=ratio.dtype, device=ratio.device).index_add_(0, x.sequence, torch.ones_like(ratio))
    faded = (4 * gate * (1 - gate) < 0.5).detach()
    return (terms / lengths[x.sequence]).sum() / max(x.num_samples, 1), faded
