"""The objectives, each written once, next to its formula.

Notation, per generated token t of sample i (all tensors are flat over the batch's loss tokens):
  logp        log pi_theta(y_t | ...)            the policy being trained (carries gradient)
  logp_old    log pi_theta_old(y_t | ...)        the trainer's policy before this update (no gradient)
  logp_rollout log pi_rollout(y_t | ...)         what the rollout engine sampled from
  A_i         the sample's advantage;  w  the TIS weight (below);  sg  stop-gradient

Each objective gives a per-token term l_t; the step's loss L is their aggregation (`aggregate`, [trainer]
loss_aggregation, verl's names), over the step's n samples, sample i having |y_i| loss tokens, N = sum_i |y_i|,
M = rollout.max_tokens:
  token-mean               L = sum_i sum_t l_t / N                  (DAPO, Yu et al. 2025)
  seq-mean-token-mean      L = mean_i (sum_t l_t / |y_i|)           (DeepSeekMath's GRPO, Shao et al. 2024; GSPO; SAPO)
  seq-mean-token-sum       L = mean_i sum_t l_t
  seq-mean-token-sum-norm  L = mean_i sum_t l_t / M                 (Dr. GRPO, Liu et al. 2025: a constant, no length
  bias)

GRPO (DeepSeekMath; the decoupled clip of DAPO), default token-mean:
  r_t = exp(logp - logp_old)
  l_t = - w_t * min(r_t * A_i, clip(r_t, 1 - eps_low, 1 + eps_high) * A_i)
Dr. GRPO ("Understanding R1-Zero-Like Training"): GRPO's l_t, default seq-mean-token-sum-norm (use it with
  normalize_advantage_std = false, the paper's other half)
GSPO (Zheng et al. 2025), default seq-mean-token-mean: one ratio per sequence, the geometric mean of its token ratios,
  s_i = exp(mean_t(logp - logp_old))
  l_t = - w_i * min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)      the same for every token of sample i,
  so with seq-mean-token-mean L = - mean_i w_i min(s_i A_i, clip(s_i) A_i), the paper's. Computed in the token form
  of the paper's GSPO-token, s_it = sg(s_i) * exp(logp - sg(logp)) (equal to s_i; the gradient of s_i spread over
  its tokens), whose gradient is the sequence form's whenever w is one per sequence (tis_level sequence, geometric,
  GSPO's default, or no TIS); with tis_level = token each token's gradient carries its own w_t instead
CISPO (MiniMax-M1, 2025), default token-mean: the importance ratio itself is clipped and detached, so clipped tokens
  keep their gradient; eps_low = 1 (the default) puts no lower bound on it, as the paper,
  l_t = - w_t * sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_i * logp_t
SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"), default seq-mean-token-mean: a smooth gate instead of the
hard clip, with a temperature tau (tau_pos = 1.0 for A > 0, tau_neg = 1.05 for A < 0, the paper's values),
  f(r) = sigmoid(tau (r - 1)) * 4 / tau          (f'(1) = 1: on-policy, the plain policy gradient)
  l_t  = - w_t * f(r_t) * A_i
  the gradient weight f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1)), fades as r leaves 1; tokens where it is below
  1/2 are reported as clipped
TIS (truncated importance sampling, Yao et al. 2025): a detached weight correcting for the rollout engine's
distribution differing from the trainer's (another engine's numerics, or an older policy when rollouts run ahead
of training), from the ratio rho = pi_theta_old / pi_rollout at one of three levels ([trainer] tis_level; each
objective has its default: token, sequence for GSPO as in TRL),
  token:      rho_t = exp(logp_old_t - logp_rollout_t)
  sequence:   rho_i = exp(sum_t (logp_old_t - logp_rollout_t))     every token of sample i gets rho_i
  geometric:  rho_i = exp(mean_t (logp_old_t - logp_rollout_t))
and one of two modes ([trainer] tis_mode):
  truncate:   w = min(rho, C)
  mask:       w = rho if rho <= C, else 0   (masked importance sampling: such tokens or samples get no loss)
KL to a reference policy, the k3 estimator (Schulman 2020), for samples drawn from p:
  KL(p || q) ~ exp(logq - logp) - (logq - logp) - 1
  added as kl_coef times its aggregation under the objective's own normaliser (`kl_penalty`)

Each objective takes a `LossInputs` for one micro-batch and returns (loss, clipped): the loss is already divided by
the whole step's normaliser, so the micro-batches' losses add up to the step's. `LossInputs` and `aggregate` are the
SDK's (`vlmreg.sdk.objective`), so a plugin's objective uses the very same.
"""

from __future__ import annotations

import math

import torch

from vlmreg.sdk.objective import LossInputs, aggregate, count_sequences, sequence_lengths

__all__ = [
    "cispo",
    "dr_grpo",
    "group_advantages",
    "grpo",
    "grpo_loss",
    "gspo",
    "gspo_loss",
    "k3",
    "kl_penalty",
    "sapo",
    "tis_weights",
]


def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = (r_i - mean of its group) / (std of its group + eps); without ``normalize_std``, only the mean is
    removed."""
    advantages = torch.empty_like(rewards, dtype=torch.float32)
    for group in groups.unique():
        members = groups == group
        r = rewards[members].float()
        centered = r - r.mean()
        advantages[members] = centered / (r.std(unbiased=False) + eps) if normalize_std else centered
    return advantages


def tis_weights(
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    cap: float,
    *,
    sequence: torch.Tensor | None = None,
    level: str = "token",
    mode: str = "truncate",
    num_sequences: int | None = None,
) -> torch.Tensor:
    """The importance weights w (detached, one per token) of the formulas above; ``sequence`` maps each token to its
    sample (0..n-1), needed for the sequence and geometric levels (``num_sequences``: n, when known)."""
    log_ratio = (logp_old - logp_rollout).detach().float()
    if level != "token":
        if sequence is None:
            raise ValueError(f"tis level {level!r} needs each token's sequence")
        n = count_sequences(sequence, num_sequences)
        sums = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(0, sequence, log_ratio)
        if level == "geometric":
            counts = torch.zeros(n, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(
                0, sequence, torch.ones_like(log_ratio)
            )
            sums = sums / counts.clamp(min=1)
        elif level != "sequence":
            raise ValueError(f"unknown tis level {level!r}")
        log_ratio = sums[sequence]
    log_cap = math.log(cap)
    if mode == "truncate":
        weights = torch.exp(log_ratio.clamp(max=log_cap))
    elif mode == "mask":
        weights = torch.where(
            log_ratio <= log_cap, torch.exp(log_ratio.clamp(max=log_cap)), torch.zeros_like(log_ratio)
        )
    else:
        raise ValueError(f"unknown tis mode {mode!r}")
    return weights.to(logp_old.dtype)


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A) and where the clipped branch won; clip_low = 1 is no
    lower bound (ratios are positive)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's per-token terms l_t (aggregate them) and which tokens were clipped."""
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
    """GSPO's per-token terms l_t in the token form (aggregate them) and which tokens were clipped. ``sequence`` maps
    each token to its sample index (0..n-1)."""
    n = count_sequences(sequence, num_sequences)
    log_ratio = (logp - logp_old).detach()
    mean_log_ratio = torch.zeros(n, dtype=logp.dtype, device=logp.device).index_add_(
        0, sequence, log_ratio
    ) / sequence_lengths(sequence, n, logp)
    # s_it: s_i in value, d s_it = s_i d logp_t
    s = torch.exp(mean_log_ratio)[sequence] * torch.exp(logp - logp.detach())
    surrogate, clipped = _clipped_surrogate(s, advantages, clip_low, clip_high)
    return -weights * surrogate, clipped


def k3(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Per-sample estimate of KL(p || q) for tokens sampled from p: exp(logq - logp) - (logq - logp) - 1 (>= 0)."""
    delta = logq - logp
    return (torch.exp(delta) - delta - 1).clamp(min=0.0)  # >= 0 exactly; rounding can dip below


def kl_penalty(kl: torch.Tensor, x: LossInputs) -> torch.Tensor:
    """The KL term's share: per-token ``kl`` under the objective's own normaliser (``x.aggregation``), or the token
    mean for an objective that declares no aggregation (it normalises itself, so there is none to follow)."""
    return aggregate(kl, x) if x.aggregation is not None else kl.sum() / max(x.total_tokens, 1)


def grpo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    terms, clipped = grpo_loss(x.logp, x.logp_old, x.advantages, x.weights, x.clip_low, x.clip_high)
    return aggregate(terms, x), clipped


def dr_grpo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's terms; only its default aggregation (seq-mean-token-sum-norm) differs."""
    return grpo(x)


def gspo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    terms, clipped = gspo_loss(
        x.logp, x.logp_old, x.advantages, x.weights, x.sequence, x.clip_low, x.clip_high, x.num_sequences
    )
    return aggregate(terms, x), clipped


def cispo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = torch.exp(x.logp - x.logp_old).detach()
    kept = ratio.clamp(1 - x.clip_low, 1 + x.clip_high)  # clip_low = 1: a lower bound of 0, i.e. none
    return aggregate(-x.weights * kept * x.advantages * x.logp, x), kept != ratio


SAPO_TAU_POSITIVE, SAPO_TAU_NEGATIVE = 1.0, 1.05


def sapo(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = torch.exp(x.logp - x.logp_old)
    tau = torch.full_like(ratio, SAPO_TAU_NEGATIVE).masked_fill(x.advantages > 0, SAPO_TAU_POSITIVE).detach()
    gate = torch.sigmoid(tau * (ratio - 1))
    faded = (4 * gate * (1 - gate) < 0.5).detach()
    return aggregate(-x.weights * gate * 4 / tau * x.advantages, x), faded
