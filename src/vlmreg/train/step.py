"""One policy update: micro-batches in, gradients accumulated, metrics out.

The loss is the registered objective ``[trainer] algorithm`` names (`vlmreg.train.losses` for the built-in ones).
Each micro-batch's loss is normalised by the whole step's count (the objective's own aggregation: loss tokens for
GRPO, sequences for GSPO, ...; the KL term under the same), so the accumulated gradient is that of one loss over the
whole batch, however it is split.
With ``updates_per_batch = N > 1`` the recipe calls `policy_update` N times on the same micro-batches, each followed
by an optimizer step, passing the logprobs `old_logprobs` took before the first update as ``logp_old``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from vlmreg.modeling.logprobs import hidden_states, selected_logprobs
from vlmreg.modeling.recompute import RecomputePlanner
from vlmreg.resolution import ResolvedFamily
from vlmreg.sdk.objective import LossInputs
from vlmreg.sdk.registry import get_objective_registry
from vlmreg.train.batching import MicroBatch
from vlmreg.train.losses import k3, kl_penalty, tis_weights
from vlmreg.train.metric_table import REDUCTIONS, reduction

__all__ = [
    "DeviceSums",
    "LossSettings",
    "average_updates",
    "lr_factor",
    "lr_scheduler",
    "old_logprobs",
    "policy_update",
    "policy_update_sums",
    "summarise",
]


@attrs.frozen
class LossSettings:
    """What `policy_update` needs to know about the loss: the objective's name (its registered loss function, unless
    ``loss`` is given), clip range, loss aggregation, TIS, KL and sampling settings."""

    algorithm: str
    clip_low: float
    clip_high: float
    tis: bool
    tis_cap: float
    kl_coef: float
    temperature: float
    suppress: tuple[int, ...] = ()
    max_tokens: int = 256
    entropy_coef: float = 0.0
    # token, sequence or geometric (`vlmreg.train.losses.tis_weights`); None: the objective's
    tis_level: str | None = None
    tis_mode: str = "truncate"  # truncate or mask
    # `vlmreg.sdk.aggregate`'s mode; None: the objective's (None again: it normalises itself)
    aggregation: str | None = None
    loss: Callable[[LossInputs], tuple[torch.Tensor, torch.Tensor]] | None = None
    #: the registered `Objective` itself, as `resolve_config` looked it up (``ResolvedConfig.specs.objective``);
    #: ``None``: looked up by ``algorithm`` when needed
    objective: Any = None

    @classmethod
    def for_run(cls, trainer: Any, rollout: Any, suppress: tuple[int, ...], objective: Any = None) -> LossSettings:
        """A run's settings from its ``[trainer]`` and ``[rollout]`` sections: what the config leaves unset (clip range,
        loss aggregation, TIS level) is the objective's default (``objective``: the resolved config's, so training
        looks nothing up by name; else the one registered as ``trainer.algorithm``)."""

        registered = objective if objective is not None else get_objective_registry().get(trainer.algorithm)
        low, high = registered.clip
        return cls(
            algorithm=trainer.algorithm,
            clip_low=trainer.clip_low if trainer.clip_low is not None else low,
            clip_high=trainer.clip_high if trainer.clip_high is not None else high,
            aggregation=trainer.loss_aggregation or registered.aggregation,
            tis=trainer.tis,
            tis_cap=trainer.tis_cap,
            tis_level=trainer.tis_level or registered.tis_level,
            tis_mode=trainer.tis_mode,
            kl_coef=trainer.kl_coef,
            temperature=rollout.temperature,
            suppress=suppress,
            max_tokens=rollout.max_tokens,
            entropy_coef=trainer.entropy_coef,
            objective=registered,
        )

    def describe(self) -> str:
        """One line for the run's log: the objective and the settings that shape its loss."""
        aggregation = self.loss_aggregation() or "its own normaliser"
        tis = f"TIS {self.importance_level()} {self.tis_mode} at {self.tis_cap:g}" if self.tis else "no TIS"
        low = "none" if self.clip_low >= 1 else f"{1 - self.clip_low:g}"
        kl = f", KL {self.kl_coef:g}" if self.kl_coef else ""
        return f"{self.algorithm}: {aggregation}, ratio clip [{low}, {1 + self.clip_high:g}], {tis}{kl}"

    def _registered(self) -> Any:
        return self.objective if self.objective is not None else get_objective_registry().get(self.algorithm)

    def loss_function(self) -> Callable[[LossInputs], tuple[torch.Tensor, torch.Tensor]]:
        return self.loss if self.loss is not None else self._registered().loss

    def loss_aggregation(self) -> str | None:
        """The aggregation the loss and the KL term use: this one, else the registered objective's default."""
        if self.aggregation is not None or self.loss is not None:
            return self.aggregation
        return self._registered().aggregation

    def importance_level(self) -> str:
        """The TIS level: this one, else the registered objective's default (token for a custom ``loss``)."""
        if self.tis_level is not None:
            return self.tis_level
        return "token" if self.loss is not None else self._registered().tis_level


class DeviceSums:
    """Running per-token statistics over a step, each combined over micro-batches as the metrics table says (a sum,
    or a max), kept on the device until `result` (reading one back to the host waits for the GPU, and the host would
    then have nothing queued for it: read them after the optimizer step is queued)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        if reduction(name) == "max":
            if not value.numel():
                return
            top = value.max()
            self.tensors[name] = torch.maximum(self.tensors[name], top) if name in self.tensors else top
        else:
            total = value.sum()
            self.tensors[name] = self.tensors[name] + total if name in self.tensors else total

    def result(self) -> dict[str, float]:
        """Every statistic as a float: one transfer to the host."""
        floats = torch.stack(list(self.tensors.values())).tolist() if self.tensors else []
        return {"tis_weight_max": 0.0} | dict(zip(self.tensors, floats, strict=True))


def policy_update(
    resolved: ResolvedFamily, microbatches: Sequence[MicroBatch], objective: LossSettings, **kwargs: Any
) -> dict[str, float]:
    """`policy_update_sums` (its keyword arguments too), the sums read at once."""
    return policy_update_sums(resolved, microbatches, objective, **kwargs).result()


def policy_update_sums(
    resolved: ResolvedFamily,
    microbatches: Sequence[MicroBatch],
    objective: LossSettings,
    *,
    num_samples: int,
    total_tokens: int | None = None,
    loss_scale: float = 1.0,
    idle: int = 0,
    reference_logprobs: Callable[[MicroBatch], torch.Tensor] | None = None,
    logp_old: Sequence[torch.Tensor] | None = None,
    recompute: RecomputePlanner | None = None,
) -> DeviceSums:
    """Forward and backward over every micro-batch (gradients accumulate; no optimizer step here); the step's sums
    stay on the device until their `DeviceSums.result` (so a caller can queue its optimizer step first).

    ``num_samples`` and ``total_tokens`` are the whole step's counts (over every rank when data-parallel);
    ``loss_scale`` undoes the averaging of gradients across ranks; the last ``idle`` micro-batches are
    repeats run with zero weight, so every rank makes the same number of forward and backward passes.
    ``logp_old``: each micro-batch's logprobs before the batch's first update (`old_logprobs`); without it, the
    policy's own, detached (right for one update per batch: then the policy *is* the one before the update).
    With ``entropy_coef > 0`` the loss gets ``- entropy_coef * (mean token entropy over the step)``.
    ``recompute`` chooses, before each micro-batch, which layers recompute their activations (a memory budget).
    """
    if total_tokens is None:
        total_tokens = sum(mb.loss_tokens for mb in microbatches)
    sums = DeviceSums()
    loss_function, aggregation, level = (
        objective.loss_function(),
        objective.loss_aggregation(),
        objective.importance_level(),
    )
    for index, mb in enumerate(microbatches):
        weight = 0.0 if index >= len(microbatches) - idle else loss_scale
        select = mb.selection
        if recompute is not None:
            recompute.prepare(mb.inputs, functools.partial(hidden_states, resolved, mb.inputs))
        logp, entropy = selected_logprobs(
            resolved,
            mb.inputs,
            mb.targets,
            select,
            temperature=objective.temperature,
            suppress=objective.suppress,
            entropy_grad=objective.entropy_coef > 0,
        )
        old = logp.detach() if logp_old is None else logp_old[index]
        logp_rollout = mb.pick(mb.rollout_logprobs)
        advantages = mb.pick(mb.advantages)
        if mb.sequence is not None:
            sequence, count = mb.sequence, mb.num_sequences
        else:
            _, sequence = torch.unique(mb.pick(mb.sample_index), return_inverse=True)
            count = int(sequence.max()) + 1 if sequence.numel() else 0
        weights = (
            tis_weights(
                old,
                logp_rollout,
                objective.tis_cap,
                sequence=sequence,
                level=level,
                mode=objective.tis_mode,
                num_sequences=count,
            )
            if objective.tis
            else torch.ones_like(logp)
        )
        inputs = LossInputs(
            logp=logp,
            logp_old=old,
            logp_rollout=logp_rollout,
            advantages=advantages,
            weights=weights,
            sequence=sequence,
            clip_low=objective.clip_low,
            clip_high=objective.clip_high,
            total_tokens=total_tokens,
            num_samples=num_samples,
            max_tokens=objective.max_tokens,
            num_sequences=count,
            aggregation=aggregation,
        )
        loss, clipped = loss_function(inputs)
        if objective.kl_coef and reference_logprobs is not None:
            kl = k3(logp, reference_logprobs(mb))
            loss = loss + objective.kl_coef * kl_penalty(kl, inputs)
            sums.add("kl_ref", kl)
        if objective.entropy_coef > 0:  # the entropy bonus: maximise the mean token entropy
            loss = loss - objective.entropy_coef * entropy.sum() / max(total_tokens, 1)
        (loss * weight).backward()
        if weight == 0.0:
            continue
        sums.add("loss", loss * max(total_tokens, 1))
        sums.add("entropy", entropy)
        sums.add("clipped", clipped.float())
        sums.add("mismatch_kl", k3(logp_rollout, old))
        sums.add("tis_weight", weights)
        if objective.tis and objective.tis_mode == "mask":
            sums.add("tis_masked", weights == 0)
        sums.add("tis_weight_max", weights)
    return sums


def summarise(sums: dict[str, float], total_tokens: int) -> dict[str, float]:
    """Per-token means of `policy_update`'s sums (after summing them over ranks)."""
    n = max(total_tokens, 1)
    metrics = {
        "loss": sums.get("loss", 0.0) / n,
        "entropy": sums.get("entropy", 0.0) / n,
        "clip_fraction": sums.get("clipped", 0.0) / n,
        "mismatch_kl": sums.get("mismatch_kl", 0.0) / n,
        "tis_weight_mean": sums.get("tis_weight", 0.0) / n,
        "tis_weight_max": sums.get("tis_weight_max", 0.0),
        "loss_tokens": float(total_tokens),
    }
    if "kl_ref" in sums:
        metrics["kl_ref"] = sums["kl_ref"] / n
    if "tis_masked" in sums:
        metrics["tis_masked_fraction"] = sums["tis_masked"] / n
    return metrics


def old_logprobs(
    resolved: ResolvedFamily, microbatches: Sequence[MicroBatch], objective: LossSettings
) -> list[torch.Tensor]:
    """Each micro-batch's logprobs under the policy as it is now, without gradient: ``logp_old`` for several updates."""
    with torch.no_grad():
        return [
            selected_logprobs(
                resolved,
                mb.inputs,
                mb.targets,
                mb.selection,
                temperature=objective.temperature,
                suppress=objective.suppress,
            )[0]
            for mb in microbatches
        ]


def average_updates(updates: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its updates' (`summarise` plus ``grad_norm``): each the mean over the updates, except
    the metrics table's maxima (``tis_weight_max``: the max) and the count ``loss_tokens`` (the same in each); with
    several updates, ``clip_fraction_last`` is the last update's."""
    if len(updates) == 1:
        return dict(updates[0])
    merged = {key: sum(u[key] for u in updates) / len(updates) for key in updates[0]}
    for key in merged:
        if REDUCTIONS.get(key) == "max":
            merged[key] = max(u[key] for u in updates)
    merged["loss_tokens"] = updates[0]["loss_tokens"]
    merged["clip_fraction_last"] = updates[-1]["clip_fraction"]
    return merged


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The learning rate of trainer step ``step`` (1, 2, ...) as a fraction of ``learning_rate``.

    Warm-up: step / warmup_steps for the first ``warmup_steps`` steps (so step ``warmup_steps`` trains at the full
    rate); then, with p = (step - warmup_steps) / (total_steps - warmup_steps) going to 1 at the last step,
    constant: 1;  linear: m + (1 - m) (1 - p);  cosine: m + (1 - m) (1 + cos(pi p)) / 2,  where m = min_lr_ratio.
    """
    if step <= warmup_steps:
        return step / warmup_steps
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return min_lr_ratio + (1 - min_lr_ratio) * (1 - progress)
    if schedule == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_schedule {schedule!r}")


def lr_scheduler(optimizer: torch.optim.Optimizer, trainer: Any, *, done: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``[trainer] lr_schedule`` (``trainer``: the config section) as a LambdaLR stepped once per trainer step,
    ``done`` steps in (so the rate of the next step is ``lr_factor(done + 1)``). A function of the step only: a
    resumed run sets it from its step, and the format warm-up, which runs before it exists, keeps ``learning_rate``."""

    def factor(steps_done: int) -> float:
        return lr_factor(
            steps_done + 1,
            schedule=trainer.lr_schedule,
            warmup_steps=trainer.warmup_steps,
            total_steps=trainer.steps,
            min_lr_ratio=trainer.min_lr_ratio,
        )

    for group in optimizer.param_groups:
        group["initial_lr"] = trainer.learning_rate
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=done - 1)
