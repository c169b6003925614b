"""Training on one rollout batch: ``Trainer.update``'s work.

Group advantages -> training samples (multi-turn merge, truncation; truncated completions masked if asked) ->
micro-batches (packed, built one ahead; under torchrun a stand-in image or clip where another rank's micro-batch has
one: `vlmreg.train.vision_ranks`) -> ``updates_per_batch`` times: forward and backward (`policy_update`), gradient
clipping, optimizer step -> learning-rate schedule -> the step's metrics, reduced over every rank as the metrics table
says (`vlmreg.train.metric_table`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from vlmreg.modeling.recompute import GIB
from vlmreg.sdk.errors import VlmregError
from vlmreg.train.batching import MicroBatch, loss_tokens, make_microbatches, microbatch_plan
from vlmreg.train.collect import RolloutBatch
from vlmreg.train.losses import group_advantages
from vlmreg.train.record import RankTotals, StepRecord, batch_totals, episode_keys, step_metrics
from vlmreg.train.samples import SampleStats, TrainingSample, build_samples
from vlmreg.train.step import average_updates, lr_scheduler, old_logprobs, policy_update_sums, summarise
from vlmreg.train.vision_ranks import media_of, stand_in_sample, stand_ins_needed

__all__ = ["train_on_batch"]


def train_on_batch(trainer: Any, batch: RolloutBatch) -> StepRecord:
    """Train a set-up `vlmreg.train.recipe.Trainer` on ``batch``; the record's metrics are reduced over every rank."""
    config = trainer.config.trainer
    samples, stats, masked = _training_samples(trainer, batch)
    if trainer.scheduler is None:
        trainer.scheduler = lr_scheduler(trainer.optimizer, config, done=batch.step - 1)
    lr = float(trainer.optimizer.param_groups[0]["lr"])
    update_started = time.perf_counter()
    device = trainer.loaded.device
    cuda = device.type == "cuda"
    if cuda:  # the update's own peak (generation's is not the trainer's to budget)
        torch.cuda.reset_peak_memory_stats(device)
    if trainer.recompute is not None:
        trainer.recompute.begin_step()
    trainer.model.train()
    total_tokens, total_samples = (int(v) for v in _global(trainer, [loss_tokens(samples), len(samples)]))
    batches, idle = _microbatches(trainer, samples)
    update: dict[str, float] = {}
    if total_samples:
        update = _optimizer_steps(trainer, batches, idle=idle, total_tokens=total_tokens, total_samples=total_samples)
        if trainer.recompute is not None:  # the largest micro-batch's plan (each rank's own: the most over ranks)
            plan = trainer.recompute.end_step(torch.cuda.max_memory_allocated(device) if cuda else None)
            figures = [plan["recomputed_layers"], plan["recomputed_vision_blocks"], plan["predicted_peak_bytes"] / GIB]
            if trainer.dist is not None:
                figures = trainer.dist.max_many(figures)
            update |= {
                "recompute_layers": int(figures[0]),
                "recompute_vision_blocks": int(figures[1]),
                "predicted_peak_gib": figures[2],
            }
    with warnings.catch_warnings():  # once per trainer step, trained or not: the schedule is a function of the step
        # a step with nothing to train
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()` before", UserWarning)
        trainer.scheduler.step()
    update_time = time.perf_counter() - update_started
    keys = episode_keys(batch.trajectories, trainer.dist)
    totals = batch_totals(
        batch, stats, masked=masked, update_tokens=sum(mb.tokens for mb in batches[: len(batches) - idle]), keys=keys
    )
    metrics = step_metrics(
        totals.reduce(trainer.dist),
        batch,
        keys=keys,
        lr=lr,
        update=update,
        samples=total_samples,
        update_s=update_time,
    )
    if cuda:
        metrics["update_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    return StepRecord(batch.step, metrics, batch)


def _global(trainer: Any, values: list[float]) -> list[float]:
    return trainer.dist.sum(values) if trainer.dist is not None else values


def _training_samples(trainer: Any, batch: RolloutBatch) -> tuple[list[TrainingSample], SampleStats, int]:
    """The batch's training samples (with truncated completions left out when ``mask_truncated``), their statistics and
    how many were left out that way."""
    config = trainer.config.trainer
    step, trajectories = batch.step, batch.trajectories
    # the collector's rules make this impossible: never train on it
    if batch.off_policy_steps > config.max_off_policy_steps:
        raise VlmregError(
            f"step {step}: its rollouts came from the policy of update {batch.policy_version}, "
            f"{batch.off_policy_steps} updates old, more than trainer.max_off_policy_steps = "
            f"{config.max_off_policy_steps}; please report it"
        )
    rewards = torch.tensor([t.reward for t in trajectories])
    groups = torch.tensor([t.group for t in trajectories])
    advantages = group_advantages(rewards, groups, normalize_std=config.normalize_advantage_std)
    samples, stats = build_samples(
        trajectories, advantages.tolist(), seq_len=config.seq_len, overlong=config.overlong, check=trainer.encoder.check
    )
    for reason in stats.break_reasons[:3]:
        trainer.log(f"warning: step {step}: {reason}")
    kept, dropped_samples = _global(trainer, [float(len(samples)), float(stats.dropped)])
    if not kept and dropped_samples:  # nothing left to learn from: an error, not a step that trains on nothing
        raise VlmregError(
            f"step {step}: all {int(dropped_samples)} samples were dropped as longer than trainer.seq_len = "
            f"{config.seq_len} (with trainer.overlong = {config.overlong!r}, no generated token fits); raise "
            "trainer.seq_len"
        )
    masked = 0
    if config.mask_truncated:  # DAPO's overlong filtering: a completion cut by max_tokens gets no loss at all
        cut = {i for i, t in enumerate(trajectories) if any(turn.finish_reason == "length" for turn in t.turns)}
        untruncated = [s for s in samples if s.trajectory not in cut]
        masked, samples = len(samples) - len(untruncated), untruncated
    return samples, stats, masked


def _microbatches(trainer: Any, samples: list[TrainingSample]) -> tuple[Sequence[MicroBatch], int]:
    """The samples' micro-batches and how many of them are idle repeats: every rank makes as many forward and backward
    passes as the busiest one, and runs its vision tower in the same ones (a stand-in image segment where a rank has
    none: `vlmreg.train.vision_ranks`)."""
    config, dist = trainer.config.trainer, trainer.dist
    plan = microbatch_plan(samples, trainer.resolved, budget=config.max_tokens_per_microbatch, packed=config.packing)
    idle = 0
    stand_ins: dict[int, TrainingSample] = {}
    if dist is not None:
        # what each micro-batch carries (images, videos), on every rank: one collective, before any is built
        every = dist.gather_objects([media_of([samples[i] for i in group]) for group in plan])
        needed = max(len(media) for media in every)
        if not plan and needed:
            raise VlmregError(f"rank {dist.rank} has no training samples this step while others do")
        idle = needed - len(plan)
        plan += [plan[-1]] * idle
        if trainer.resolved.vision_blocks:  # FSDP2 shards them one by one: each gathers when it runs
            wanted = stand_ins_needed(every, dist.rank)
            made = {media: stand_in_sample(trainer.encoder, media) for media in set(wanted.values())}
            stand_ins = {index: made[media] for index, media in wanted.items()}
    if not plan:
        return [], 0
    batches = make_microbatches(  # built one ahead while the GPU works on the previous one
        samples,
        trainer.resolved,
        trainer.encoder,
        budget=config.max_tokens_per_microbatch,
        packed=config.packing,
        device=trainer.loaded.device,
        prefetch=True,
        plan=plan,
        stand_ins=stand_ins,
    )
    return batches, idle


def policy_sum_names(trainer: Any) -> tuple[str, ...]:
    """The per-token sums `policy_update` returns with the trainer's settings (every rank reduces the same names)."""
    names = ["loss", "entropy", "clipped", "mismatch_kl", "tis_weight"]
    if trainer.reference is not None:
        names.append("kl_ref")
    if trainer.objective.tis and trainer.objective.tis_mode == "mask":
        names.append("tis_masked")
    return (*names, "tis_weight_max")


def _optimizer_steps(
    trainer: Any,
    batches: Sequence[MicroBatch],
    *,
    idle: int,
    total_tokens: int,
    total_samples: int,
) -> dict[str, float]:
    """``updates_per_batch`` optimizer steps on ``batches``; their metrics, merged by `average_updates`. Several updates
    per batch (PPO epochs): every one measures its ratio against the policy before the first."""
    config, dist = trainer.config.trainer, trainer.dist
    logp_old = old_logprobs(trainer.resolved, batches, trainer.objective) if config.updates_per_batch > 1 else None
    updates = []
    for _ in range(config.updates_per_batch):
        trainer.optimizer.zero_grad(set_to_none=True)
        on_device = policy_update_sums(
            trainer.resolved,
            batches,
            trainer.objective,
            num_samples=total_samples,
            total_tokens=total_tokens,
            loss_scale=float(dist.world if dist else 1),
            idle=idle,
            reference_logprobs=trainer.reference,
            logp_old=logp_old,
            recompute=trainer.recompute,
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in trainer.model.parameters() if p.requires_grad], config.max_grad_norm
        )
        trainer.optimizer.step()  # queued before the sums are read: the host waits once, with the GPU busy
        sums = on_device.result()
        totals = RankTotals()
        totals.update({name: sums.get(name, 0.0) for name in policy_sum_names(trainer)})
        one = summarise(totals.reduce(dist), total_tokens)
        one["grad_norm"] = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        updates.append(one)
    return average_updates(updates)
