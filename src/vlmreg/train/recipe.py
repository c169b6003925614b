"""The GRPO / GSPO recipe: ``setup``, ``train``, ``save_checkpoint``, ``cleanup``.

``setup`` goes in named parts: the model (loaded, sharded, compiled), the optimizer, the data, the rollout side
(`vlmreg.train.rollout_setup`), the objective, the resume, the run's records. A step is two values: ``collect(step)``
-> `RolloutBatch` (prompts from the example source -> episodes on the rollout engine -> rewards; the policy version that
sampled them) and ``update(batch)`` -> `StepRecord` (`vlmreg.train.batch_update`: group advantages -> training samples
-> micro-batches -> loss and backward -> optimizer step (``updates_per_batch`` times) -> learning-rate schedule ->
metrics, reduced over ranks as the metrics table says, `vlmreg.train.metric_table`); then the weights go to a rollout
server apart, when there is one. The embedded engine samples from the very weights being trained; with a server,
``[trainer] max_off_policy_steps = N`` collects up to N steps ahead while the trainer updates (`vlmreg.train.collect`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from vlmreg.config.resolve import ResolvedConfig
from vlmreg.data.store import ImageStore
from vlmreg.data.unknown_tokens import warn_unknown_tokens
from vlmreg.loading.load import load
from vlmreg.rollout.episodes import Trajectory
from vlmreg.sdk.engine import SamplingParams
from vlmreg.sdk.errors import VlmregError
from vlmreg.train.batch_update import train_on_batch
from vlmreg.train.checkpoint import CheckpointError, resume_checkpoint, save_checkpoint
from vlmreg.train.collect import AheadCollector, RolloutBatch
from vlmreg.train.distributed import from_environment, initialize_from_root, raise_on_every_rank, release_process_group, shard_model
from vlmreg.train.episodes import evaluate_greedy, play_episodes
from vlmreg.train.metrics import MetricsWriter
from vlmreg.train.optim import CompensatedAdamW
from vlmreg.modeling.recompute import GIB, RecomputePlanner
from vlmreg.train.record import StepRecord
from vlmreg.train.reference import reference_logprobs
from vlmreg.train.report import write_rollout_page
from vlmreg.train.rollout_setup import build_rollout_side
from vlmreg.train.rundir import RunLock, claim_on_every_rank, write_lora_targets, write_run_config
from vlmreg.train.source import ExampleSource, load_run_data
from vlmreg.train.step import LossSettings
from vlmreg.train.warmup import format_warmup

__all__ = ["Trainer"]


class Trainer:
    """One run. ``setup`` claims the output directory (see `vlmreg.train.rundir`) and ``cleanup`` releases it.

    ``resume`` continues the run in the output directory (a config that makes it another run is refused unless
    ``allow_config_change``); ``overwrite`` moves a previous run there into ``previous/<UTC time>/`` first; without
    either, a directory holding a run is refused. ``writes_output=False`` (``vlmreg eval``) neither claims nor writes it.
    """

    def __init__(
        self, rc: ResolvedConfig, *, output_dir: Path | None = None, resume: bool = False, overwrite: bool = False,
        base_dir: Path = Path("."), log: Callable[[str], None] = print, writes_output: bool = True, allow_config_change: bool = False,
    ):
        self.rc, self.config = rc, rc.config
        self.output_dir = Path(output_dir or self.config.trainer.output_dir)
        self.resume, self.overwrite, self.base_dir, self.log = resume, overwrite, base_dir, log
        self.allow_config_change, self.writes_output = allow_config_change, writes_output
        self.step = self.steps_trained = 0  # steps_trained: by this trainer (`train` counts them)
        self.on_step: Callable[[dict[str, Any]], None] | None = None  # each step's metrics record (main rank)
        self.on_rollouts: Callable[[int, list[Trajectory]], None] | None = None  # each step's trajectories (main rank)
        self.on_checkpoint: Callable[[Path], None] | None = None  # each checkpoint written (main rank)
        # what `setup` makes, part by part (None until then: `cleanup` releases what a failed setup got to)
        self.dist: Any = None  # `vlmreg.train.distributed.Distributed` under torchrun
        self.main = True  # the process that writes and speaks for the run
        self.run_lock: RunLock | None = None
        self.loaded = self.resolved = self.model = self.processor = cast(Any, None)  # the model part (Any: None until then)
        self.optimizer: Any = None
        self.recompute: RecomputePlanner | None = None  # which layers recompute their activations ([trainer] memory_budget_gib)
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None  # made by the first update: `lr_scheduler`
        self.store = self.data = self.eval_data = self.source = cast(Any, None)  # the data part (eval's on first use)
        self._source_state: Any = None  # where the source stands after the last trained batch (checkpoints save it)
        self.engine = self.link = self.encoder = self.sampling = cast(Any, None)  # the rollout side (`build_rollout_side`)
        self.template_kwargs: dict[str, Any] = {}  # the thinking mode, as the chat template receives it
        self.objective = self.reference = cast(Any, None)  # `LossSettings`; the reference model's logprobs (kl_coef > 0)
        self.metrics: MetricsWriter | None = None
        self.ahead: AheadCollector | None = None  # collecting rollouts ahead of training (max_off_policy_steps >= 1)
        self._step_clock = 0.0  # when the step being trained began

    # -- setup -----------------------------------------------------------------------------
    def setup(self) -> None:
        """The run's parts, in order: its process and output directory, model, optimizer, data, rollout side,
        objective, resume, and its records (metrics, run config)."""
        trainer = self.config.trainer
        self.dist = from_environment(trainer.device)
        self.main = self.dist is None or self.dist.is_main
        if self.writes_output:  # before the model loads: a wrong directory fails in seconds
            self.run_lock = claim_on_every_rank(self.output_dir, self.dist, resume=self.resume, overwrite=self.overwrite, log=self.log,
                                                config=self.config, allow_config_change=self.allow_config_change)
        torch.manual_seed(trainer.seed)
        random.seed(trainer.seed)
        self._setup_model()
        self._setup_optimizer()
        self._setup_data()
        self._setup_rollout()
        self._setup_objective()
        resume_step = self._setup_resume()
        self._setup_records(resume_step)

    def _setup_model(self) -> None:
        """Load the model and its processor; gradient checkpointing, FSDP2 shards (torchrun), compiled layers."""
        trainer = self.config.trainer
        self.loaded = load(self.rc)
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
            shard_model(self.resolved, self.dist, trainer.fsdp_prefetch_layers)
            initialize_from_root(self.resolved.model, self.processor.tokenizer.eos_token_id, self.loaded.device)
            torch.manual_seed(trainer.seed + 1_000_003 * self.dist.rank)  # each rank samples its own completions
        if trainer.compile:  # decoder layers and vision blocks, each its own compiled call
            for block in (*self.resolved.layers, *(self.resolved.vision_blocks or ())):
                block.compile(dynamic=True)

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _setup_optimizer(self) -> None:
        """AdamW (compensated in bf16/fp16: `vlmreg.train.optim`) over the trainable parameters; the recompute planner."""
        trainer = self.config.trainer
        params = self._trainable()
        if not params:
            raise VlmregError("nothing to train: every parameter is frozen (check [model.vlm] and [model.lora])")
        if trainer.compensated_updates and any(p.dtype in (torch.bfloat16, torch.float16) for p in params):  # else: fp32, exact
            self.optimizer = CompensatedAdamW(params, lr=trainer.learning_rate, weight_decay=trainer.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(params, lr=trainer.learning_rate, weight_decay=trainer.weight_decay)
        if trainer.memory_budget_gib is not None:  # which layers recompute their activations, chosen per micro-batch
            # each rank plans for itself; only the main one speaks (before `_setup_records` quiets the others' log too)
            self.recompute = RecomputePlanner(self.resolved, int(trainer.memory_budget_gib * GIB), optimizer=self.optimizer,
                                              log=lambda message: self.log(message) if self.main else None,
                                              prefetch=trainer.fsdp_prefetch_layers if self.dist is not None else 0)

    def _setup_data(self) -> None:
        """The image store, the training data (the task's examples and environments) and the source that deals them out."""
        self.store = ImageStore(pin_memory=self.loaded.device.type == "cuda")  # pixels to the GPU without a host copy
        self.data = load_run_data(self.rc, self.store, base_dir=self.base_dir)
        warn_unknown_tokens(self.processor, self.data.examples, self.resolved.descriptor.name, self.log if self.main else lambda message: None)
        self.source = ExampleSource(self.data.examples, self.config.data.seed)
        self._source_state = self.source.state()

    def _setup_rollout(self) -> None:
        """The rollout engine (and the server apart it talks to), the prompt encoder, the sampling parameters."""
        side = build_rollout_side(self.rc, self.loaded, self.store, output_dir=self.output_dir, log=self.log, dist=self.dist)
        self.engine, self.link, self.encoder, self.sampling = side.engine, side.link, side.encoder, side.sampling
        descriptor = self.resolved.descriptor
        if self.config.trainer.packing and not descriptor.packing:
            self.log(f"note: family {descriptor.name} declares packing unsupported; micro-batches are padded instead")
        self.template_kwargs = self.rc.chat_template_kwargs

    def _setup_objective(self) -> None:
        """The loss settings of the registered objective ``[trainer] algorithm`` names; the reference model (KL)."""
        self.objective = LossSettings.for_run(self.config.trainer, self.config.rollout, self.sampling.suppress_token_ids, self.rc.specs.objective)
        if self.main:  # one line for the run, not one per rank
            self.log(f"objective {self.objective.describe()}")
        self.reference = reference_logprobs(self.loaded, self.objective) if self.config.trainer.kl_coef > 0 else None

    def _setup_resume(self) -> int | None:
        """With ``resume``: the checkpoint `latest` names, or the newest good one before it (each one skipped is a
        warning), loaded; the step it resumes from."""
        if not self.resume:
            return None
        checkpoint, state = resume_checkpoint(
            self.output_dir / "checkpoints", self.model, self.optimizer, self.dist,
            log=self.log if self.main else lambda message: None, check_state=lambda saved: self.source.restore(saved["source"]),
        )
        self.step = int(state["step"])
        self.source.restore(state["source"])
        self._source_state = self.source.state()
        self.log(f"resumed from {checkpoint} (step {self.step})")
        return self.step

    def _setup_records(self, resume_step: int | None) -> None:
        """The run's config and metrics (on the main process), its LoRA targets, and a line saying what trains."""
        if not self.main:
            self.log = lambda message: None
        elif self.writes_output:  # the run's config, as it resumes (or begins): what the next --resume compares with
            write_run_config(self.output_dir, self.config)
        self.metrics = MetricsWriter(
            self.output_dir, tensorboard=self.config.logging.tensorboard, resume_step=resume_step,
            enabled=self.main and self.writes_output, log=self.log, sinks=tuple(self.config.logging.sinks), config=self.config,
        )
        report, descriptor = self.loaded.lora, self.resolved.descriptor
        if report is not None and self.main and self.writes_output:  # exactly which modules got adapters, for the record
            write_lora_targets(self.output_dir, report)
        adapters = f", LoRA {report.targets}: {len(report.modules)} modules + {len(report.parameters)} parameters" if report else ""
        trainable = sum(p.numel() for p in self._trainable())
        self.log(
            f"{descriptor.name} on {self.loaded.device} ({str(self.loaded.dtype).removeprefix('torch.')}): {trainable:,} trainable parameters"
            f"{adapters}; {self.data.description}"
        )

    # -- train -----------------------------------------------------------------------------
    def train(self) -> None:
        """Steps ``step + 1 .. trainer.steps``: synchronously (`train_step`), or with rollouts collected ahead by up
        to ``max_off_policy_steps`` policy versions (`vlmreg.train.collect`)."""
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
                self._finish_step(self.train_step(step))
        else:
            self._train_ahead(first)
        if not trainer.save_every or self.step % trainer.save_every:
            self._checkpoint()

    def train_step(self, step: int) -> StepRecord:
        """One synchronous step: collect batch ``step``, train on it, sync the server apart (if any)."""
        batch = self.collect(step)
        if self.link is not None:  # nothing uses the server until the sync: its workers may be asked for it now
            self.link.post_early(step)
        return self._sync(self.update(batch))

    def _train_ahead(self, first: int) -> None:
        """Steps ``first .. trainer.steps`` with batches collected up to ``max_off_policy_steps`` ahead."""
        trainer = self.config.trainer
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

    def _sync(self, record: StepRecord) -> StepRecord:
        """The server gets the weights of update ``record.step``."""
        if self.link is not None:
            record.metrics.update(self.link.timed_sync(record.step))
        return record

    def _finish_step(self, record: StepRecord) -> None:
        """After update ``record.step`` (and its sync): evaluation, metrics, callbacks, rollout page, checkpoint."""
        trainer, logging = self.config.trainer, self.config.logging
        step, trajectories = record.step, record.batch.trajectories
        self.step, self._source_state = step, record.batch.source_state
        self.steps_trained += 1
        record.metrics["step_s"] = time.perf_counter() - self._step_clock
        if self.config.eval.every and step % self.config.eval.every == 0:
            record.metrics.update(self.evaluate())
        assert self.metrics is not None, "setup made it"
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
        environments ``make_env`` makes (by default the training data's): `vlmreg.train.episodes`."""
        return play_episodes(self, examples, group_size=group_size, sampling=sampling, make_env=make_env or self.data.make_env)

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

    def update(self, batch: RolloutBatch) -> StepRecord:
        """Train on ``batch`` (`vlmreg.train.batch_update`): group advantages, samples, micro-batches, optimizer steps,
        the learning-rate schedule; metrics reduced over every rank. First the server's answer to the last sync is taken
        (`ServerLink.settle`): no update trains on a failed sync's rollouts."""
        if self.link is not None:
            self.link.settle()
        return train_on_batch(self, batch)

    def format_warmup(self, steps: int) -> None:
        """Supervised steps on answers drawn at random from the task's choices: the format, not the task."""
        format_warmup(self, steps)

    def evaluate(self) -> dict[str, float]:
        """Greedy decoding on the held-out split, a collection of its own: mean reward (and its size)."""
        if self.eval_data is None:
            self.eval_data = load_run_data(self.rc, self.store, base_dir=self.base_dir, split="eval")
        return evaluate_greedy(self, self.eval_data)

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
        raise_on_every_rank(self.dist, error, CheckpointError)  # also the barrier: no rank goes on before it is in place
        self.log(f"checkpoint {path}")
        return path

    def cleanup(self, *, failed: BaseException | None = None) -> None:
        """Release the run; ``failed``: the error that ends it (under torchrun, see `release_process_group`)."""
        if self.metrics is not None:
            self.metrics.close()
        if self.link is not None:
            self.link.close()
        if self.dist is not None:
            release_process_group(self.dist.rank, failed=failed)
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None
