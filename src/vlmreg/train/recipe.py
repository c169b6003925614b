"""The GRPO / GSPO recipe: ``setup``, ``train``, ``save_checkpoint``, ``cleanup``.

A step is two values: ``collect(step)`` -> `RolloutBatch` (prompts from the example source -> episodes on the
rollout engine -> rewards; the policy version that sampled them) and ``update(batch)`` -> `StepRecord` (group
advantages -> training samples (multi-turn merge, truncation; truncated completions masked if asked) -> micro-batches
(packed) -> loss and backward -> optimizer step (``updates_per_batch`` times) -> learning-rate schedule -> metrics,
reduced over ranks); then the weights go to a rollout server apart, when there is one. The embedded engine samples
from the very weights being trained; with a server, ``[trainer] max_off_policy_steps = N`` collects up to N steps
ahead while the trainer updates (`vlmreg.train.collect`).
"""

from __future__ import annotations

import contextlib
import random
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from vlmreg.config.resolve import ResolvedConfig
from vlmreg.data.prompts import PromptEncoder, vision_token_ids
from vlmreg.data.store import ImageStore
from vlmreg.data.unknown_tokens import warn_unknown_tokens
from vlmreg.loading.load import LoadedModel, load
from vlmreg.rollout.episodes import Trajectory, run_episodes
from vlmreg.sdk.engine import EngineContext, SamplingParams
from vlmreg.sdk.errors import VlmregError
from vlmreg.train.batching import MicroBatch, loss_tokens, make_microbatches
from vlmreg.train.checkpoint import CheckpointError, resume_checkpoint, save_checkpoint
from vlmreg.train.collect import AheadCollector, RolloutBatch
from vlmreg.train.distributed import from_environment, initialize_from_root, release_process_group, shard_model, unsharded
from vlmreg.train.losses import group_advantages
from vlmreg.train.metrics import MetricsWriter
from vlmreg.train.record import RankTotals, StepRecord, batch_totals, episode_keys, step_metrics
from vlmreg.train.report import write_rollout_page
from vlmreg.train.rundir import RunLock, claim_output_dir, write_run_config
from vlmreg.train.samples import build_samples
from vlmreg.train.source import ExampleSource, RunData, load_run_data
from vlmreg.train.recompute import GIB, RecomputePlanner
from vlmreg.train.reference import reference_logprobs
from vlmreg.train.step import LossSettings, average_updates, lr_scheduler, old_logprobs, policy_update, summarise
from vlmreg.train.warmup import format_warmup

__all__ = ["Trainer"]

Log = Callable[[str], None]


@contextlib.contextmanager
def _eager(compiled: bool) -> Any:
    """Generation runs eagerly even when the layers are compiled (its shapes change at every token)."""
    if not compiled:
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


class Trainer:
    """One run. ``setup`` claims the output directory (see `vlmreg.train.rundir`) and ``cleanup`` releases it.

    ``resume`` continues the run in the output directory (a config that makes it another run is refused unless
    ``allow_config_change``); ``overwrite`` moves a previous run there into ``previous/<UTC time>/`` first; without
    either, a directory holding a run is refused. ``writes_output=False`` (``vlmreg eval``) neither claims nor writes it.
    """

    def __init__(
        self, rc: ResolvedConfig, *, output_dir: Path | None = None, resume: bool = False, overwrite: bool = False,
        base_dir: Path = Path("."), log: Log = print, writes_output: bool = True, allow_config_change: bool = False,
    ):
        self.rc, self.config = rc, rc.config
        self.output_dir = Path(output_dir or self.config.trainer.output_dir)
        self.resume, self.overwrite, self.base_dir, self.log = resume, overwrite, base_dir, log
        self.allow_config_change, self.writes_output = allow_config_change, writes_output
        self.run_lock: RunLock | None = None
        self.step = 0
        self.steps_trained = 0  # by this trainer: `train` counts them
        self.on_step: Callable[[dict[str, Any]], None] | None = None  # each step's metrics record (main rank)
        self.on_rollouts: Callable[[int, list[Trajectory]], None] | None = None  # each step's trajectories (main rank)
        self.on_checkpoint: Callable[[Path], None] | None = None  # each checkpoint written (main rank)
        self.ahead: AheadCollector | None = None  # collecting rollouts ahead of training (max_off_policy_steps >= 1)

    # -- setup -----------------------------------------------------------------------------
    def setup(self) -> None:
        trainer, rollout = self.config.trainer, self.config.rollout
        self.dist = from_environment(trainer.device)
        self.main = self.dist is None or self.dist.is_main
        if self.writes_output:  # before the model loads: a wrong directory fails in seconds
            self.run_lock = self._claim_output_dir()
        torch.manual_seed(trainer.seed)
        random.seed(trainer.seed)
        self.loaded: LoadedModel = load(self.rc)
        self.resolved = self.loaded.resolved
        self.model, self.processor = self.loaded.model, self.loaded.processor
        descriptor = self.resolved.descriptor
        if descriptor.prepare_model is not None:
            descriptor.prepare_model(self.resolved.model)
        if trainer.gradient_checkpointing:
            self.resolved.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.dist is not None:
            if trainer.kl_coef > 0:
                raise VlmregError("trainer.kl_coef > 0 is not supported with several processes yet")
            if trainer.memory_budget_gib is not None:  # sharded weights and their gathers are not in its measurements
                raise VlmregError("trainer.memory_budget_gib is not supported with several processes (torchrun) yet; "
                                  "use trainer.gradient_checkpointing or a smaller trainer.max_tokens_per_microbatch")
            shard_model(self.resolved, self.dist)
            initialize_from_root(self.resolved.model, self.processor.tokenizer.eos_token_id, self.loaded.device)
            torch.manual_seed(trainer.seed + 1_000_003 * self.dist.rank)  # each rank samples its own completions
        if trainer.compile:
            for layer in self.resolved.layers:
                layer.compile(dynamic=True)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise VlmregError("nothing to train: every parameter is frozen (check [model.vlm] and [model.lora])")
        if trainer.compensated_updates and any(p.dtype in (torch.bfloat16, torch.float16) for p in params):  # else: fp32, exact
            from vlmreg.train.optim import CompensatedAdamW

            self.optimizer = CompensatedAdamW(params, lr=trainer.learning_rate, weight_decay=trainer.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=trainer.learning_rate, weight_decay=trainer.weight_decay)
        self.recompute: RecomputePlanner | None = None
        if trainer.memory_budget_gib is not None:  # which layers recompute their activations, chosen per micro-batch
            self.recompute = RecomputePlanner(self.resolved, int(trainer.memory_budget_gib * GIB), optimizer=self.optimizer,
                                              log=lambda message: self.log(message))  # quiet where the trainer's log is
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None  # made by the first update: `lr_scheduler`
        self.store = ImageStore()
        self.data: RunData = load_run_data(self.rc, self.store, base_dir=self.base_dir)
        warn_unknown_tokens(self.processor, self.data.examples, descriptor.name, self.log if self.main else lambda message: None)
        self.source = ExampleSource(self.data.examples, self.config.data.seed)
        self._source_state = self.source.state()  # where the source stands after the last trained batch (checkpoints save it)
        self.link = None
        spec = self.rc.specs.engine  # [rollout] engine: the registered rollout engine, looked up by resolve_config
        context = EngineContext(rc=self.rc, model=self.model, processor=self.processor, store=self.store, device=self.loaded.device,
                                descriptor=descriptor, output_dir=self.output_dir)
        if spec.server:  # a server apart: launched or attached, its weights kept the trainer's
            from vlmreg.train.server_link import ServerLink

            self.link = ServerLink(self.rc, self.resolved, self.loaded.device, self.output_dir, self.log, self.dist, processor=self.processor,
                                   peft_model=self.model if self.loaded.lora is not None else None)
            context = attrs.evolve(context, url=self.link.url, api_key=self.link.api_key, cache_scope=self.link.cache_scope)
        self.engine: Any = spec.build(context)
        if self.link is not None and len(self.link.urls) > 1:  # one engine per server; each prompt group on one of them
            from vlmreg.rollout.server_pool import ServerPool

            engines = [self.engine] + [spec.build(attrs.evolve(context, url=url)) for url in self.link.urls[1:]]
            self.engine = ServerPool(engines, self.link.urls)
        self.encoder: PromptEncoder = getattr(self.engine, "encoder", None) or PromptEncoder(self.processor, self.store, descriptor)
        suppress = vision_token_ids(self.processor, descriptor)
        self.sampling = SamplingParams(
            temperature=rollout.temperature, top_p=rollout.top_p, max_tokens=rollout.max_tokens,
            stop_token_ids=self.encoder.stop_ids, suppress_token_ids=suppress, thinking_budget=rollout.thinking_budget,
        )
        if trainer.packing and not descriptor.packing:
            self.log(f"note: family {descriptor.name} declares packing unsupported; micro-batches are padded instead")
        self.template_kwargs = self.rc.chat_template_kwargs  # the thinking mode, as the chat template receives it
        self.objective = LossSettings.for_run(trainer, rollout, suppress)
        self.log(f"objective {self.objective.describe()}")
        self.reference = reference_logprobs(self.loaded, self.objective) if trainer.kl_coef > 0 else None
        resume_step = None
        if self.resume:  # the checkpoint `latest` names, or the newest good one before it (each one skipped is a warning)
            checkpoint, state = resume_checkpoint(
                self.output_dir / "checkpoints", self.model, self.optimizer, self.dist,
                log=self.log if self.main else lambda message: None, check_state=lambda saved: self.source.restore(saved["source"]),
            )
            self.step = int(state["step"])
            self.source.restore(state["source"])
            self._source_state = self.source.state()
            resume_step = self.step
            self.log(f"resumed from {checkpoint} (step {self.step})")
        if not self.main:
            self.log = lambda message: None
        elif self.writes_output:  # the run's config, as it resumes (or begins): what the next --resume compares with
            write_run_config(self.output_dir, self.config)
        self.metrics = MetricsWriter(
            self.output_dir, tensorboard=self.config.logging.tensorboard, resume_step=resume_step,
            enabled=self.main and self.writes_output, log=self.log, sinks=tuple(self.config.logging.sinks), config=self.config,
        )
        report = self.loaded.lora
        if report is not None and self.main and self.writes_output:  # exactly which modules got adapters, for the record
            import json

            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "lora_targets.json").write_text(
                json.dumps({"targets": report.targets, "modules": list(report.modules), "parameters": list(report.parameters),
                            "trainable_parameters": report.trainable_parameters}, indent=2)
            )
        adapters = f", LoRA {report.targets}: {len(report.modules)} modules + {len(report.parameters)} parameters" if report else ""
        trainable = sum(p.numel() for p in params)
        self.log(
            f"{descriptor.name} on {self.loaded.device} ({str(self.loaded.dtype).removeprefix('torch.')}): {trainable:,} trainable parameters"
            f"{adapters}; {self.data.description}"
        )

    def _claim_output_dir(self) -> RunLock | None:
        """Rank 0 claims the output directory (usable, locked, no other run in it); every rank learns the outcome."""
        lock, error = None, None
        if self.main:
            try:
                lock = claim_output_dir(self.output_dir, resume=self.resume, overwrite=self.overwrite, log=self.log,
                                        config=self.config, allow_config_change=self.allow_config_change)
            except VlmregError as exc:
                error = exc
        if self.dist is not None:
            message = next((m for m in self.dist.gather_objects(str(error) if error else None) if m), None)
            if message is not None and error is None:
                raise VlmregError(message)
        if error is not None:
            raise error
        return lock

    # -- train -----------------------------------------------------------------------------
    def train(self) -> None:
        """Steps ``step + 1 .. trainer.steps``: synchronously (collect, update, sync), or with rollouts collected
        ahead by up to ``max_off_policy_steps`` policy versions (`vlmreg.train.collect`)."""
        trainer = self.config.trainer
        if self.step >= trainer.steps:  # resumed at or past the last step: say so, and leave the run as it is
            self.log(f"note: nothing trained: the checkpoint is at step {self.step} and trainer.steps = {trainer.steps}, so the run "
                     f"stays at step {self.step}; raise trainer.steps above {self.step} (--set trainer.steps=N) to train further")
            return
        if self.step == 0 and trainer.format_warmup_steps:
            self.format_warmup(trainer.format_warmup_steps)
        if self.link is not None:  # the server starts from exactly the trainer's weights, frozen tower included
            self.link.sync(self.step, full=True)
        first = self.step + 1
        self._step_clock = time.perf_counter()
        if trainer.max_off_policy_steps == 0 or first > trainer.steps:
            for step in range(first, trainer.steps + 1):
                record = self.update(self.collect(step))
                self._sync(record)
                self._finish_step(record)
        else:
            self.ahead = AheadCollector(self.collect, first=first, last=trainer.steps, ahead=trainer.max_off_policy_steps, version=self.step)
            try:
                for step in range(first, trainer.steps + 1):
                    waited = time.perf_counter()
                    batch = self.ahead.get(step)
                    waited = time.perf_counter() - waited
                    record = self.update(batch)
                    held = time.perf_counter()
                    with self.ahead.sync(step):  # first waits for batch step + N: collecting it is the rest of the wait
                        record.metrics["rollout_wait_s"] = waited + time.perf_counter() - held
                        self._sync(record)
                    self._finish_step(record)
            finally:
                self.ahead.close(timeout_s=self.config.rollout.request_timeout_s)
                self.ahead = None
        if not trainer.save_every or self.step % trainer.save_every:
            self._checkpoint()

    def train_step(self, step: int) -> tuple[dict[str, Any], list[Trajectory]]:
        """One synchronous step (collect, update, sync): its metrics and trajectories."""
        started = time.perf_counter()
        record = self.update(self.collect(step))
        self._sync(record)
        record.metrics["step_s"] = time.perf_counter() - started
        return record.metrics, record.batch.trajectories

    def _sync(self, record: StepRecord) -> None:
        """The server gets the weights of update ``record.step``."""
        if self.link is None:
            return
        started = time.perf_counter()
        self.link.sync(record.step)
        record.metrics["sync_s"] = time.perf_counter() - started

    def _finish_step(self, record: StepRecord) -> None:
        """After update ``record.step`` (and its sync): evaluation, metrics, callbacks, rollout page, checkpoint."""
        trainer, logging = self.config.trainer, self.config.logging
        step, trajectories = record.step, record.batch.trajectories
        self.step, self._source_state = step, record.batch.source_state
        self.steps_trained += 1
        record.metrics["step_s"] = time.perf_counter() - self._step_clock
        if self.config.eval.every and step % self.config.eval.every == 0:
            record.metrics.update(self.evaluate())
        self.metrics.write(record.metrics)
        if self.on_rollouts and self.main:
            self.on_rollouts(step, trajectories)
        if self.on_step and self.main:
            self.on_step(record.metrics)
        if self.main and logging.rollout_page_every and (step % logging.rollout_page_every == 0 or step == 1):
            write_rollout_page(self.output_dir / "rollouts" / f"step_{step:06d}.html", step, trajectories, self.store)
        if trainer.save_every and step % trainer.save_every == 0:
            self._checkpoint()
        self._step_clock = time.perf_counter()

    def _checkpoint(self) -> None:
        path = self.save_checkpoint()
        if self.on_checkpoint and self.main:
            self.on_checkpoint(path)

    def rollouts(
        self, examples: list[Any], *, group_size: int, sampling: SamplingParams, make_env: Callable[[Any], Any] | None = None,
    ) -> list[Trajectory]:
        """Episodes for this rank's share of ``examples`` (all of them in one process), ``group_size`` each, in the
        environments ``make_env`` makes (by default the training data's)."""
        if self.dist is not None:
            examples = examples[self.dist.rank :: self.dist.world]
        pairs = [(example, g) for g, example in enumerate(examples) for _ in range(group_size)]
        limit = self.config.rollout.max_images_per_step or 0

        def dropped(example_id: str, count: int) -> None:
            self.log(f"warning: {example_id}: dropped {count} image(s) of a message over rollout.max_images_per_step = {limit}")

        local = self.link is None  # the embedded engine samples from the trainer's own (sharded, compiled) model
        gathered = unsharded(self.model, self.dist) if local else contextlib.nullcontext()
        with gathered, _eager(self.config.trainer.compile and local), self._server_errors():
            return run_episodes(
                pairs,
                make_env or self.data.make_env,
                self.engine,
                sampling,
                max_images_per_message=limit,
                template_kwargs=self.template_kwargs,
                image_only=self.config.rollout.image_only_mode,
                thinking_end=self.resolved.descriptor.thinking_end,
                on_drop=dropped,
                max_images_in_context=self.config.rollout.max_images_in_context,
                env_timeout_s=self.config.rollout.env_timeout_s,
                env_concurrency=self.config.rollout.env_concurrency,
                max_turns=self.config.rollout.max_turns,
            )

    @contextlib.contextmanager
    def _server_errors(self) -> Any:
        """A failed request to a launched server that has died reports the death (exit code, log) instead."""
        try:
            yield
        except VlmregError:
            if self.link is not None:
                self.link.check_alive()
            raise

    def _global(self, values: list[float]) -> list[float]:
        return self.dist.sum(values) if self.dist is not None else values

    def collect(self, step: int, version: int | None = None) -> RolloutBatch:
        """Batch ``step``: ``prompts_per_step`` examples from the source, ``group_size`` episodes each, sampled by
        the engine's weights, those of update ``version`` (by default ``step - 1``: the policy being trained)."""
        started = time.perf_counter()
        examples = self.source.take(self.config.trainer.prompts_per_step)
        state = self.source.state()
        before = list(getattr(self.engine, "completions", ()))  # a `ServerPool`'s count per server
        trajectories = self.rollouts(examples, group_size=self.config.rollout.group_size, sampling=self.sampling)
        version = step - 1 if version is None else version
        for trajectory in trajectories:
            trajectory.policy_version = version
        per_server = tuple(after - was for after, was in zip(getattr(self.engine, "completions", ()), before, strict=True))
        return RolloutBatch(step, trajectories, version, time.perf_counter() - started, state, per_server=per_server)

    def _policy_sums(self) -> tuple[str, ...]:
        """The per-token sums `policy_update` returns with these settings (every rank reduces the same names)."""
        names = ["loss", "entropy", "clipped", "mismatch_kl", "tis_weight"]
        if self.reference is not None:
            names.append("kl_ref")
        if self.objective.tis and self.objective.tis_mode == "mask":
            names.append("tis_masked")
        return tuple(names)

    def update(self, batch: RolloutBatch) -> StepRecord:
        """Train on ``batch``: group advantages, training samples (multi-turn merge, truncation, truncated completions
        masked if asked), micro-batches, ``updates_per_batch`` optimizer steps, the learning-rate schedule. The
        record's metrics are reduced over every rank."""
        trainer = self.config.trainer
        step, trajectories = batch.step, batch.trajectories
        if batch.off_policy_steps > trainer.max_off_policy_steps:  # the collector's rules make this impossible: never train on it
            raise VlmregError(
                f"step {step}: its rollouts came from the policy of update {batch.policy_version}, {batch.off_policy_steps} updates old, "
                f"more than trainer.max_off_policy_steps = {trainer.max_off_policy_steps}; please report it"
            )
        rewards = torch.tensor([t.reward for t in trajectories])
        groups = torch.tensor([t.group for t in trajectories])
        advantages = group_advantages(rewards, groups, normalize_std=trainer.normalize_advantage_std)
        samples, stats = build_samples(
            trajectories, advantages.tolist(), seq_len=trainer.seq_len, overlong=trainer.overlong, check=self.encoder.check
        )
        for reason in stats.break_reasons[:3]:
            self.log(f"warning: step {step}: {reason}")
        kept, dropped_samples = self._global([float(len(samples)), float(stats.dropped)])
        if not kept and dropped_samples:  # nothing left to learn from: an error, not a step that trains on nothing
            raise VlmregError(
                f"step {step}: all {int(dropped_samples)} samples were dropped as longer than trainer.seq_len = {trainer.seq_len} "
                f"(with trainer.overlong = {trainer.overlong!r}, no generated token fits); raise trainer.seq_len"
            )
        masked = 0
        if trainer.mask_truncated:  # DAPO's overlong filtering: a completion cut by max_tokens gets no loss at all
            cut = {i for i, t in enumerate(trajectories) if any(turn.finish_reason == "length" for turn in t.turns)}
            untruncated = [s for s in samples if s.trajectory not in cut]
            masked, samples = len(samples) - len(untruncated), untruncated
        if self.scheduler is None:
            self.scheduler = lr_scheduler(self.optimizer, trainer, done=step - 1)
        lr = float(self.optimizer.param_groups[0]["lr"])
        update_started = time.perf_counter()
        cuda = self.loaded.device.type == "cuda"
        if cuda:  # the update's own peak (generation's is not the trainer's to budget)
            torch.cuda.reset_peak_memory_stats(self.loaded.device)
        if self.recompute is not None:
            self.recompute.begin_step()
        self.model.train()
        batches: Sequence[MicroBatch] = make_microbatches(  # built one ahead while the GPU works on the previous one
            samples, self.resolved, self.encoder,
            budget=trainer.max_tokens_per_microbatch, packed=trainer.packing, device=self.loaded.device, prefetch=True,
        ) if samples else []
        total_tokens, total_samples = (int(v) for v in self._global([loss_tokens(samples), len(samples)]))
        idle = 0
        if self.dist is not None:  # every rank makes as many forward/backward passes as the busiest one
            batches = list(batches)
            needed = self.dist.max(len(batches))
            if not batches and needed:
                raise VlmregError(f"rank {self.dist.rank} has no training samples this step while others do")
            idle = needed - len(batches)
            batches = batches + [batches[-1]] * idle
        update: dict[str, float] = {}
        if total_samples:
            # several updates per batch (PPO epochs): every one measures its ratio against the policy before the first
            logp_old = old_logprobs(self.resolved, batches, self.objective) if trainer.updates_per_batch > 1 else None
            updates = []
            for _ in range(trainer.updates_per_batch):
                self.optimizer.zero_grad(set_to_none=True)
                sums = policy_update(
                    self.resolved, batches, self.objective, num_samples=total_samples, total_tokens=total_tokens,
                    loss_scale=float(self.dist.world if self.dist else 1), idle=idle, reference_logprobs=self.reference,
                    logp_old=logp_old, recompute=self.recompute,
                )
                totals = RankTotals()
                totals.update({name: sums.get(name, 0.0) for name in self._policy_sums()})
                totals.add("tis_weight_max", sums["tis_weight_max"], "max")
                one = summarise(totals.reduce(self.dist), total_tokens)
                grad_norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], trainer.max_grad_norm)
                self.optimizer.step()
                one["grad_norm"] = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
                updates.append(one)
            update = average_updates(updates)
            if self.recompute is not None:  # the largest micro-batch's plan
                plan = self.recompute.end_step(torch.cuda.max_memory_allocated(self.loaded.device) if cuda else None)
                update |= {"recompute_layers": plan["recomputed_layers"], "recompute_vision_blocks": plan["recomputed_vision_blocks"],
                           "predicted_peak_gib": plan["predicted_peak_bytes"] / GIB}
        with warnings.catch_warnings():  # once per trainer step, trained or not: the schedule is a function of the step
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()` before", UserWarning)  # a step with nothing to train
            self.scheduler.step()
        update_time = time.perf_counter() - update_started
        keys = episode_keys(batch.trajectories, self.dist)
        totals = batch_totals(batch, stats, masked=masked, update_tokens=sum(mb.tokens for mb in batches[: len(batches) - idle]), keys=keys)
        metrics = step_metrics(
            totals.reduce(self.dist), batch, keys=keys, lr=lr, update=update, samples=total_samples, update_s=update_time,
        )
        if cuda:
            metrics["update_peak_gib"] = torch.cuda.max_memory_allocated(self.loaded.device) / GIB
        return StepRecord(step, metrics, batch)

    def format_warmup(self, steps: int) -> None:
        """Supervised steps on answers drawn at random from the task's choices: the format, not the task."""
        format_warmup(self, steps)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy decoding on the held-out split, a collection of its own: mean reward (and its size)."""
        if not hasattr(self, "eval_data"):
            self.eval_data = load_run_data(self.rc, self.store, base_dir=self.base_dir, split="eval")
        state = torch.get_rng_state()
        greedy = attrs.evolve(self.sampling, greedy=True)
        holding = self.ahead.exclusive() if self.ahead is not None else contextlib.nullcontext()  # no batch in flight meanwhile
        try:
            with holding:
                trajectories = self.rollouts(self.eval_data.examples, group_size=1, sampling=greedy, make_env=self.eval_data.make_env)
        finally:
            torch.set_rng_state(state)
        total, count = self._global([sum(t.reward for t in trajectories), float(len(trajectories))])
        return {"eval_reward_mean": total / count, "eval_samples": count}

    # -- checkpoints and cleanup -------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write a checkpoint (rank 0); a failed write (a full disk) ends the run on every rank with rank 0's error."""
        error = None
        try:
            path = save_checkpoint(
                self.output_dir / "checkpoints", self.step, self.model, self.optimizer, {"source": self._source_state}, ctx=self.dist
            )
        except CheckpointError as exc:
            error = exc
        if self.dist is not None:  # also the barrier: no rank goes on before the checkpoint is in place
            message = next((m for m in self.dist.gather_objects(str(error) if error else None) if m), None)
            if message is not None and error is None:
                raise CheckpointError(message)
        if error is not None:
            raise error
        self.log(f"checkpoint {path}")
        return path

    def cleanup(self, *, failed: BaseException | None = None) -> None:
        """Release the run; ``failed``: the error that ends it (under torchrun, see `release_process_group`)."""
        if hasattr(self, "metrics"):
            self.metrics.close()
        if getattr(self, "link", None) is not None:
            self.link.close()
        if getattr(self, "dist", None) is not None:
            release_process_group(self.dist.rank, failed=failed)
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None
