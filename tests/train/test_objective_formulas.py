"""Each objective's formula as docs/training.md writes it, differentiated independently, against the trainer's update.

The reference side writes every formula out here, on a padded (samples x tokens) batch with a mask, with torch
autograd and nothing from vlmreg's loss code: the ratios, the importance weights at each level, each objective's
per-token term, each aggregation, and the KL penalty under it. The other side is `vlmreg.train.step.policy_update`,
the function a run calls, on the same numbers split into two micro-batches (only the model's logprobs are stood in
for: they are the batch's ``logp``). Losses and gradients must agree, per objective, per aggregation.
"""

from __future__ import annotations

import pytest
import torch

import vlmreg
from vlmreg.sdk import LossInputs
from vlmreg.train import step
from vlmreg.train.batching import MicroBatch
from vlmreg.train.step import LossSettings, policy_update

# Three samples of 3, 1 and 2 loss tokens (padded to 3). Log ratios logp - logp_old: in range and outside it on both
# sides, per token and per sample (GSPO: means 0.1, 0.5, -0.025); logp_old - logp_rollout: weights under and over the
# cap.
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
OLD = torch.tensor([[-1.0, -2.0, -0.7], [-1.2, 0.0, 0.0], [-0.4, -3.0, 0.0]], dtype=torch.float64)
LOG_RATIO = torch.tensor([[0.1, 0.4, -0.2], [0.5, 0.0, 0.0], [-0.1, 0.05, 0.0]], dtype=torch.float64)
ROLLOUT = OLD - torch.tensor([[0.3, -0.2, 0.5], [0.9, 0.0, 0.0], [-0.4, 0.1, 0.0]], dtype=torch.float64)
REF = OLD + torch.tensor([[0.2, -0.3, 0.1], [-0.6, 0.0, 0.0], [0.4, 0.25, 0.0]], dtype=torch.float64)
ADV = torch.tensor([1.0, 0.5, -1.5], dtype=torch.float64)
CAP, MAX_TOKENS, KL_COEF = 2.0, 4, 0.3
CLIP = {"grpo": (0.2, 0.28), "dr_grpo": (0.2, 0.28), "gspo": (0.2, 0.28), "cispo": (1.0, 0.28), "sapo": (0.2, 0.28)}
# What each objective follows when the config says nothing: the papers' normalisers, and GSPO's weight per sequence
# (TRL)
PAPER_AGGREGATION = {
    "grpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "gspo": "seq-mean-token-mean",
    "cispo": "token-mean",
    "sapo": "seq-mean-token-mean",
}
PAPER_TIS_LEVEL = {"grpo": "token", "dr_grpo": "token", "gspo": "sequence", "cispo": "token", "sapo": "token"}
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def importance_weight(level: str) -> torch.Tensor:
    """w = min(rho, C), rho = pi_old / pi_rollout: per token, the sample's product, or its geometric mean."""
    log_rho = (OLD - ROLLOUT) * MASK
    if level == "sequence":
        log_rho = log_rho.sum(1, keepdim=True).expand_as(OLD)
    elif level == "geometric":
        log_rho = (log_rho.sum(1) / MASK.sum(1)).unsqueeze(1).expand_as(OLD)
    return torch.exp(log_rho).clamp(max=CAP)


def aggregated(terms: torch.Tensor, mode: str) -> torch.Tensor:
    """docs/training.md's aggregations over the padded batch: n samples, |y_i| tokens each, N in all, M the max
    tokens."""
    per_sample = (terms * MASK).sum(1)
    if mode == "token-mean":
        return per_sample.sum() / MASK.sum()
    if mode == "seq-mean-token-mean":
        return (per_sample / MASK.sum(1)).mean()
    if mode == "seq-mean-token-sum":
        return per_sample.mean()
    return (per_sample / MAX_TOKENS).mean()  # seq-mean-token-sum-norm


def documented_loss(name: str, logp: torch.Tensor, mode: str, level: str) -> torch.Tensor:
    """The objective's per-token term as docs/training.md writes it, aggregated, plus the KL penalty under the same."""
    low, high = CLIP[name]
    w, a = importance_weight(level), ADV[:, None]
    r = torch.exp(logp - OLD)
    if name in ("grpo", "dr_grpo"):
        terms = -w * torch.minimum(r * a, r.clamp(1 - low, 1 + high) * a)
    elif name == "gspo" and level != "token":
        s = torch.exp(((logp - OLD) * MASK).sum(1) / MASK.sum(1))[:, None]  # the sequence ratio, with its gradient
        terms = (-w * torch.minimum(s * a, s.clamp(1 - low, 1 + high) * a)).expand_as(OLD)  # the same on every token
    elif name == "gspo":  # token weights: the token form, s_it = sg(s_i) exp(logp_t - sg(logp_t))
        s = torch.exp(((logp - OLD) * MASK).sum(1) / MASK.sum(1)).detach()[:, None] * torch.exp(logp - logp.detach())
        terms = -w * torch.minimum(s * a, s.clamp(1 - low, 1 + high) * a)
    elif name == "cispo":  # no lower bound on the ratio (clip_low = 1), only the upper one; the weight is detached
        terms = -w * r.clamp(max=1 + high).detach() * a * logp
    else:  # sapo
        tau = torch.where(a > 0, 1.0, 1.05)
        terms = -w * torch.sigmoid(tau * (r - 1)) * 4 / tau * a
    delta = REF - logp
    kl = torch.exp(delta) - delta - 1
    return aggregated(terms, mode) + KL_COEF * aggregated(kl, mode)


def microbatch(rows: list[int]) -> MicroBatch:
    mask = MASK[rows]
    selected = mask.flatten().nonzero().squeeze(1)
    local = torch.arange(len(rows))[:, None].expand_as(mask)
    return MicroBatch(
        inputs={"rows": torch.tensor(rows)},
        targets=torch.zeros(mask.shape, dtype=torch.long),
        loss_mask=mask,
        rollout_logprobs=ROLLOUT[rows],
        advantages=ADV[rows][:, None].expand_as(mask).contiguous(),
        sample_index=torch.tensor(rows)[:, None].expand_as(mask).contiguous(),
        samples=tuple(rows),
        tokens=int(mask.sum()),
        selected=selected,
        sequence=local.flatten().index_select(0, selected),
        num_sequences=len(rows),
    )


def trainer_loss(monkeypatch, name: str, aggregation: str | None, level: str | None) -> tuple[float, torch.Tensor]:
    """`policy_update` on two micro-batches (samples 0 and 1, then 2): the step's loss and d loss / d logp."""
    logp = (OLD + LOG_RATIO).clone().requires_grad_()
    monkeypatch.setattr(
        step,
        "selected_logprobs",
        lambda resolved, inputs, targets, select, **kw: (
            logp[inputs["rows"]].flatten().index_select(0, select),
            torch.zeros(select.numel(), dtype=logp.dtype),
        ),
    )
    batches = [microbatch([0, 1]), microbatch([2])]
    settings = LossSettings(
        algorithm=name,
        clip_low=CLIP[name][0],
        clip_high=CLIP[name][1],
        tis=True,
        tis_cap=CAP,
        kl_coef=KL_COEF,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        aggregation=aggregation,
        tis_level=level,
    )
    sums = policy_update(
        None,
        batches,
        settings,
        num_samples=3,
        total_tokens=int(MASK.sum()),
        reference_logprobs=lambda mb: mb.pick(REF[list(mb.samples)]),
        logp_old=[mb.pick(OLD[list(mb.samples)]) for mb in batches],
    )
    return sums["loss"] / int(MASK.sum()), logp.grad * MASK


def compare(monkeypatch, name: str, aggregation: str | None, level: str | None) -> None:
    loss, grad = trainer_loss(monkeypatch, name, aggregation, level)
    logp = (OLD + LOG_RATIO).clone().requires_grad_()
    expected = documented_loss(name, logp, aggregation or PAPER_AGGREGATION[name], level or PAPER_TIS_LEVEL[name])
    expected.backward()
    # within float32 round-off: the importance weights and the step's sums are float32, whatever the logprobs' dtype
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(grad, logp.grad * MASK, rtol=1e-6, atol=1e-9), (grad, logp.grad * MASK)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("aggregation", [None, *AGGREGATIONS], ids=lambda a: a or "paper-default")
@pytest.mark.parametrize("name", list(PAPER_AGGREGATION))
def test_each_objective_under_each_aggregation_has_the_documented_gradient(monkeypatch, name, aggregation):
    compare(monkeypatch, name, aggregation, None)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("name", ["gspo", "grpo"])
def test_each_importance_weight_level_has_the_documented_gradient(monkeypatch, name, level):
    compare(monkeypatch, name, None, level)


def test_the_defaults_are_the_papers(monkeypatch):
    """None in the config is the objective's registered default: each paper's aggregation and GSPO's sequence weight."""

    registry = vlmreg.get_objective_registry()
    assert {name: registry.get(name).aggregation for name in PAPER_AGGREGATION} == PAPER_AGGREGATION
    assert {name: registry.get(name).tis_level for name in PAPER_TIS_LEVEL} == PAPER_TIS_LEVEL
    assert registry.get("cispo").clip[0] == 1.0  # MiniMax-M1 puts no lower bound on the ratio


def test_gspo_of_two_tokens_with_token_weights_the_issue_s_case():
    """One sample of 2 tokens, on-policy, A = 1, token weights (2, 0.5). The formula docs/training.md had (a mean of
    w_t times the sequence's clipped ratio, differentiated as written) gives [-0.625, -0.625]; the code's token form
    [-1.0, -0.25]; GSPO's default sequence weight (2 x 0.5 = 1) gives the paper's [-0.5, -0.5] either way."""

    def code(weights: list[float]) -> list[float]:
        logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
        x = LossInputs(
            logp=logp,
            logp_old=logp.detach(),
            logp_rollout=logp.detach(),
            advantages=torch.ones(2, dtype=torch.float64),
            weights=torch.tensor(weights, dtype=torch.float64),
            sequence=torch.tensor([0, 0]),
            clip_low=3e-4,
            clip_high=4e-4,
            total_tokens=2,
            num_samples=1,
            max_tokens=4,
            aggregation="seq-mean-token-mean",
        )
        vlmreg.get_objective_registry().get("gspo").loss(x)[0].backward()
        return logp.grad.tolist()

    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    s = torch.exp((logp - logp.detach()).mean())
    (-(torch.tensor([2.0, 0.5], dtype=torch.float64) * torch.minimum(s, s.clamp(1 - 3e-4, 1 + 4e-4))).mean()).backward()
    assert logp.grad.tolist() == pytest.approx([-0.625, -0.625])  # the old documented formula
    assert code([2.0, 0.5]) == pytest.approx([-1.0, -0.25])  # tis_level = token: each token's own weight
    assert code([1.0, 1.0]) == pytest.approx([-0.5, -0.5])  # the default: the sequence's weight


def test_cispo_without_a_lower_bound_keeps_a_tiny_ratio_as_its_weight():
    """r = e^-5 = 0.0067 with A = -1: MiniMax-M1 (and the default, clip_low = 1) weighs the token by r itself; a lower
    bound of 0.01 (the old default, clip_low = 0.99) would raise it to 0.01."""

    def gradient(clip_low: float) -> float:
        logp = torch.tensor([-6.0], dtype=torch.float64, requires_grad=True)
        x = LossInputs(
            logp=logp,
            logp_old=torch.tensor([-1.0], dtype=torch.float64),
            logp_rollout=torch.tensor([-1.0], dtype=torch.float64),
            advantages=-torch.ones(1, dtype=torch.float64),
            weights=torch.ones(1, dtype=torch.float64),
            sequence=torch.tensor([0]),
            clip_low=clip_low,
            clip_high=0.28,
            total_tokens=1,
            num_samples=1,
            max_tokens=4,
            aggregation="token-mean",
        )
        vlmreg.get_objective_registry().get("cispo").loss(x)[0].backward()
        return logp.grad.item()

    default = vlmreg.get_objective_registry().get("cispo").clip[0]
    assert gradient(default) == pytest.approx(torch.exp(torch.tensor(-5.0, dtype=torch.float64)).item())
    assert gradient(0.99) == pytest.approx(0.01)


def test_a_self_normalising_objective_keeps_the_token_mean_kl(monkeypatch):
    """An objective that declares no aggregation (a plugin's own normaliser) gets the KL term as a token mean."""
    logp = (OLD + LOG_RATIO).clone().requires_grad_()
    monkeypatch.setattr(
        step,
        "selected_logprobs",
        lambda resolved, inputs, targets, select, **kw: (
            logp[inputs["rows"]].flatten().index_select(0, select),
            torch.zeros(select.numel(), dtype=logp.dtype),
        ),
    )

    def nothing(x):
        return (x.logp * 0).sum(), torch.zeros_like(x.logp, dtype=torch.bool)

    settings = LossSettings(
        algorithm="nothing",
        clip_low=0.2,
        clip_high=0.28,
        tis=False,
        tis_cap=CAP,
        kl_coef=KL_COEF,
        temperature=1.0,
        loss=nothing,
    )
    batches = [microbatch([0, 1]), microbatch([2])]
    policy_update(
        None,
        batches,
        settings,
        num_samples=3,
        total_tokens=int(MASK.sum()),
        reference_logprobs=lambda mb: mb.pick(REF[list(mb.samples)]),
    )
    reference = (OLD + LOG_RATIO).clone().requires_grad_()
    delta = REF - reference
    (KL_COEF * ((torch.exp(delta) - delta - 1) * MASK).sum() / MASK.sum()).backward()
    assert torch.allclose(logp.grad * MASK, reference.grad * MASK, rtol=1e-6, atol=1e-9)


def test_sapo_reports_as_clipped_the_tokens_whose_gradient_weight_fell_below_one_half():
    """SAPO's gradient weight f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1)), read off autograd on the plain formula
    f(r) = sigmoid(tau (r - 1)) * 4 / tau: a token is reported clipped exactly where it is below 1/2."""

    ratios = torch.tensor([1.0, 0.3, 2.5, 3.0, 4.0, 0.05, 2.7, 2.8], dtype=torch.float64)
    advantages = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    old = torch.full_like(ratios, -2.0)
    x = LossInputs(
        logp=old + ratios.log(),
        logp_old=old,
        logp_rollout=old,
        advantages=advantages,
        weights=torch.ones_like(ratios),
        sequence=torch.arange(8),
        clip_low=0.2,
        clip_high=0.28,
        total_tokens=8,
        num_samples=8,
        max_tokens=4,
        aggregation="token-mean",
    )
    _, faded = vlmreg.get_objective_registry().get("sapo").loss(x)
    r = ratios.clone().requires_grad_()
    tau = torch.where(advantages > 0, 1.0, 1.05).double()
    (torch.sigmoid(tau * (r - 1)) * 4 / tau).sum().backward()
    expected = r.grad < 0.5
    # both sides of r = 2.76 (tau = 1)
    assert expected.tolist() == [False, False, False, True, True, False, False, True]
    assert faded.tolist() == expected.tolist()
