"""`vlmreg.train(...)`: a training run from Python, on the code path `vlmreg train` uses.

    import vlmreg

    result = vlmreg.train("run.toml", overrides=["trainer.steps=20"],
                          output_dir="runs/x", on_step=lambda record: print(record["reward_mean"]))
    result.final["reward_mean"], result.checkpoint

``config`` is a TOML path, a `RunConfig` or a `ResolvedConfig`; ``overrides`` are ``--set`` strings (with a path).
Callbacks run on the main rank: ``on_step(record)`` with each step's metrics, ``on_rollouts(step, trajectories)``
with each step's episodes, ``on_checkpoint(path)`` with each checkpoint written. Errors are the CLI's
(`VlmregError` subclasses naming what is wrong); an interrupt is `TrainingInterrupted`, with the step reached.
The output directory is cleaned up (its lock released, a launched server stopped) however the run ends.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from vlmreg.config import ConfigError, RunConfig, apply_sets, load_config, parse_config
from vlmreg.config.load import blame_sets
from vlmreg.config.resolve import ResolvedConfig, resolve_config
from vlmreg.config.toml_out import to_toml

__all__ = ["RunResult", "TrainingInterrupted", "train"]


class TrainingInterrupted(KeyboardInterrupt):
    """The run was interrupted (Ctrl-C); ``step`` is the last step completed, ``output_dir`` holds its checkpoints."""

    def __init__(self, step: int, output_dir: Path) -> None:
        super().__init__(f"interrupted at step {step}")
        self.step, self.output_dir = step, output_dir


@attrs.frozen
class RunResult:
    """What a finished run left: its directory, the last step, that step's metrics and the last checkpoint."""

    output_dir: Path
    step: int
    final: dict[str, Any]
    checkpoint: Path | None
    main: bool = True  # False on the other ranks of a torchrun job
    steps_trained: int = 0  # by this call: 0 when a resumed run had already reached trainer.steps

    @property
    def metrics_path(self) -> Path:
        return self.output_dir / "metrics.jsonl"


def _resolved(
    config: str | Path | RunConfig | ResolvedConfig | dict, overrides: Sequence[str]
) -> tuple[ResolvedConfig, Path]:
    if isinstance(config, ResolvedConfig):
        if overrides:
            raise TypeError("overrides apply to a config path or RunConfig, not to a ResolvedConfig")
        return config, Path.cwd()
    if isinstance(config, dict):
        config = parse_config(config)
    if isinstance(config, RunConfig):
        if overrides:
            try:
                config = parse_config(apply_sets(tomllib.loads(to_toml(config)), overrides))
            except ConfigError as exc:
                raise blame_sets(exc, overrides) from None
        return resolve_config(config, sets=overrides), Path.cwd()
    path = Path(config)
    return resolve_config(load_config(path, overrides), source=str(path), sets=overrides), path.resolve().parent


def _last_record(path: Path) -> dict[str, Any]:
    lines = [line for line in path.read_text().splitlines() if line] if path.exists() else []
    return json.loads(lines[-1]) if lines else {}


def train(
    config: str | Path | RunConfig | ResolvedConfig | dict,
    *,
    overrides: Sequence[str] = (),
    output_dir: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    allow_config_change: bool = False,
    log: Callable[[str], None] = print,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    on_rollouts: Callable[[int, list[Any]], None] | None = None,
    on_checkpoint: Callable[[Path], None] | None = None,
    base_dir: str | Path | None = None,
) -> RunResult:
    """Run training to ``[trainer] steps`` (see the module docstring); return its `RunResult`.

    ``resume`` continues the run in the output directory (when its checkpoint is at or past ``trainer.steps``,
    nothing is trained: a note says so and ``steps_trained`` is 0); a config that makes it another run (another model,
    objective, group size, data, reward: `vlmreg.train.runconfig.RUN_DEFINING`) is refused unless
    ``allow_config_change``; other changes are logged.

    ``base_dir``: where relative data paths are read from (default: the config file's folder, else the cwd)."""
    # deferred: start-up cost (loads safetensors, torch)
    from vlmreg.train.checkpoint import latest_checkpoint  # noqa: PLC0415

    # deferred: start-up cost (loads asyncio, concurrent, safetensors, torch, urllib.request)
    from vlmreg.train.recipe import Trainer  # noqa: PLC0415

    rc, found_base = _resolved(config, overrides)
    trainer = Trainer(
        rc,
        output_dir=Path(output_dir) if output_dir is not None else None,
        resume=resume,
        overwrite=overwrite,
        allow_config_change=allow_config_change,
        base_dir=Path(base_dir) if base_dir is not None else found_base,
        log=log,
    )
    trainer.on_step, trainer.on_rollouts, trainer.on_checkpoint = on_step, on_rollouts, on_checkpoint
    failed: BaseException | None = None
    try:
        trainer.setup()
        if trainer.main:  # one process speaks for a torchrun job (the trainer silences the others' log)
            log(f"output: {trainer.output_dir}")
        trainer.train()
    except KeyboardInterrupt:
        raise TrainingInterrupted(trainer.step, trainer.output_dir) from None
    except BaseException as exc:
        failed = exc
        raise
    finally:
        trainer.cleanup(failed=failed)
    main = getattr(trainer, "main", True)
    return RunResult(
        output_dir=trainer.output_dir,
        step=trainer.step,
        final=_last_record(trainer.output_dir / "metrics.jsonl"),
        checkpoint=latest_checkpoint(trainer.output_dir / "checkpoints"),
        main=main,
        steps_trained=trainer.steps_trained,
    )
