"""The output directory a run owns: usable, locked for the run's lifetime, and never silently reused.

`claim_output_dir` runs before the model loads, so a wrong directory fails in seconds:

- a path under a regular file, or a directory that cannot be written, is an error naming the path;
- ``OUTPUT/.lock`` is locked (``flock``, exclusive) and holds the owner's pid; a second trainer gets an error naming
  the directory and that pid. The kernel drops the lock when its process dies, however it dies, so a lock left by a
  killed run is never stale: the file stays, the lock does not;
- a directory that already holds a run (``metrics.jsonl`` with records, or ``checkpoints/step_*``) is refused
  unless the run is resumed, or ``overwrite`` asks for the old run's outputs to be moved aside first: they are
  renamed (never copied, never deleted) into ``OUTPUT/previous/<UTC timestamp>/``, so an overwrite loses nothing and
  needs no free space; each overwrite keeps its own folder there;
- a resumed run's config is compared with the one the run keeps (`vlmreg.train.runconfig`): a change that makes it
  another run is refused unless ``allow_config_change``.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from vlmreg.config.schema import RunConfig
from vlmreg.sdk.errors import VlmregError
from vlmreg.train.checkpoint import checkpoint_steps, latest_checkpoint
from vlmreg.train.distributed import Distributed, raise_on_every_rank
from vlmreg.train.runconfig import check_resumed_config, write_run_config

__all__ = [
    "LOCK_NAME",
    "PREVIOUS_NAME",
    "RUN_OUTPUTS",
    "RunLock",
    "claim_on_every_rank",
    "claim_output_dir",
    "describe_run",
    "write_lora_targets",
    "write_run_config",
]

LOCK_NAME = ".lock"
# what --overwrite moves ("weights": the filesystem transport's syncs, when [broadcast] directory does not put them
# elsewhere)
RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "rollouts", "tensorboard", "lora_targets.json", "config.toml", "weights")
PREVIOUS_NAME = "previous"  # OUTPUT/previous/<UTC timestamp>/ holds each run --overwrite moved aside
_CHOOSE = "choose another --output-dir (or trainer.output_dir)"


class RunLock:
    """The exclusive lock on ``OUTPUT/.lock``, held until `release` (or until the process ends).

    ``created_lock``: this claim created the lock file; ``created``: the folders it created, deepest first."""

    def __init__(
        self, path: Path, file: IO[str], *, created_lock: bool = False, created: tuple[Path, ...] = ()
    ) -> None:
        self.path, self._file = path, file
        self.created_lock, self.created = created_lock, created

    def release(self) -> None:
        """Unlock; a directory the run left holding nothing but the lock file it created (a run refused or failed
        before it wrote anything) is put back as it was: that file, and the folders the claim created, removed."""
        if self._file.closed:
            return
        try:
            if self.created_lock and [p.name for p in self.path.parent.iterdir()] == [LOCK_NAME]:
                # while still holding the lock: another trainer cannot have taken this file meanwhile
                self.path.unlink()
                _remove_empty(self.created)
        except OSError:  # tidying is a courtesy: a directory that cannot be listed or changed stays as it is
            pass
        fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        self._file.close()


def _remove_empty(folders: tuple[Path, ...]) -> None:
    """Remove ``folders`` (deepest first) while they are empty; stop at the first that is not."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _make_directory(output_dir: Path) -> tuple[Path, ...]:
    """Create ``output_dir``; returns the folders that did not exist before, deepest first."""
    missing: list[Path] = []
    for path in (output_dir, *output_dir.parents):  # the nearest existing path must be a directory
        if path.exists() or path.is_symlink():
            if not path.is_dir():
                where = "is a file" if path == output_dir else f"is under {path}, which is a file"
                raise VlmregError(f"output directory {output_dir} {where}, not a directory; {_CHOOSE}")
            break
        missing.append(path)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_empty(tuple(missing))  # what part of the path was made before the failure
        raise VlmregError(f"output directory {output_dir} cannot be created ({_reason(exc)}); {_CHOOSE}") from exc
    return tuple(missing)


def _check_writable(directory: Path, output_dir: Path) -> None:
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise VlmregError(
            f"output directory {output_dir} is not writable ({directory}: {_reason(exc)}); {_CHOOSE}"
        ) from exc


def _lock(output_dir: Path, created: tuple[Path, ...]) -> RunLock:
    path = output_dir / LOCK_NAME
    created_lock = False
    try:
        try:  # created here, or there already (left by an earlier run: the file stays, its lock does not)
            file = os.fdopen(
                os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644), "a+", encoding="utf-8"
            )
            created_lock = True
        except FileExistsError:
            file = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the run's lifetime
    except OSError as exc:
        raise VlmregError(f"output directory {output_dir} is not writable ({path}: {_reason(exc)}); {_CHOOSE}") from exc
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        file.seek(0)
        holder = file.read().strip() or "unknown"
        file.close()
        raise VlmregError(
            f"output directory {output_dir} is in use by another trainer (pid {holder}, lock {path}); "
            f"wait for it to end, or {_CHOOSE}"
        ) from exc
    except OSError as exc:  # a filesystem without locks
        file.close()
        if created_lock:
            path.unlink(missing_ok=True)
        raise VlmregError(
            f"output directory {output_dir} cannot be locked ({path}: {_reason(exc)}); {_CHOOSE}"
        ) from exc
    file.seek(0)
    file.truncate()
    file.write(f"{os.getpid()}\n")
    file.flush()
    return RunLock(path, file, created_lock=created_lock, created=created)


def describe_run(output_dir: Path) -> str | None:
    """What a previous run left in ``output_dir`` (``"metrics.jsonl, 2 checkpoints up to step_000006"``), or
    ``None``."""
    found = []
    metrics = output_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    steps = checkpoint_steps(output_dir / "checkpoints")
    if steps:
        found.append(f"{len(steps)} checkpoint(s) up to {steps[-1][1].name}")
    return ", ".join(found) or None


def _aside_folder(output_dir: Path) -> Path:
    """A new, empty ``OUTPUT/previous/<UTC timestamp>/`` (``-2``, ``-3`` ... added when that second is taken)."""
    previous = output_dir / PREVIOUS_NAME
    if previous.is_symlink() or (previous.exists() and not previous.is_dir()):
        raise VlmregError(
            f"--overwrite: {previous} is not a directory, so the previous run cannot be moved there; {_CHOOSE}"
        )
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    for n in range(1, 1000):
        aside = previous / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            aside.mkdir(parents=True)
            return aside
        except FileExistsError:
            continue
        except OSError as exc:
            raise VlmregError(f"--overwrite: cannot create {aside} ({_reason(exc)}); nothing was moved") from exc
    raise VlmregError(f"--overwrite: {previous} already holds a folder for every name tried for {stamp}")


def _move_run_aside(output_dir: Path) -> Path:
    """Rename this directory's run outputs into a new ``previous/<UTC timestamp>/``; returns that folder."""
    aside = _aside_folder(output_dir)
    for name in RUN_OUTPUTS:
        path = output_dir / name
        if not (path.exists() or path.is_symlink()):
            continue
        try:
            path.rename(aside / name)  # same filesystem: atomic, no copy, no space needed
        except OSError as exc:
            raise VlmregError(
                f"--overwrite: cannot move {path} to {aside / name} ({_reason(exc)}); what was already moved is in "
                f"{aside}, the rest is where it was"
            ) from exc
    return aside


def claim_output_dir(
    output_dir: Path,
    *,
    resume: bool,
    overwrite: bool,
    log: Callable[[str], None],
    config: RunConfig | None = None,
    allow_config_change: bool = False,
) -> RunLock:
    """Make ``output_dir`` this run's: created, writable, locked, and free of another run (see the module doc).

    With ``resume``, ``config`` (the new resolved config) is checked against the run's own (`check_resumed_config`)."""
    if resume and overwrite:
        raise VlmregError(
            "--resume and --overwrite contradict each other: resume continues the run, overwrite moves it aside"
        )
    if allow_config_change and not resume:
        raise VlmregError("--allow-config-change is for --resume: a new run has no earlier config to differ from")
    created = _make_directory(output_dir)
    try:
        lock = _lock(output_dir, created)
    except BaseException:
        _remove_empty(created)
        raise
    try:
        _check_writable(output_dir, output_dir)
        checkpoints = output_dir / "checkpoints"
        if checkpoints.is_dir():
            _check_writable(checkpoints, output_dir)
        elif checkpoints.exists() or checkpoints.is_symlink():
            raise VlmregError(
                f"output directory {output_dir} cannot hold checkpoints: {checkpoints} is a file; {_CHOOSE}"
            )
        if resume:
            if latest_checkpoint(checkpoints, log=lambda message: None) is None:
                raise VlmregError(f"--resume: no checkpoint in {checkpoints}")
            if config is not None:
                check_resumed_config(output_dir, config, allow_change=allow_config_change, log=log)
            return lock
        previous = describe_run(output_dir)
        if previous is not None:
            if not overwrite:
                raise VlmregError(
                    f"output directory {output_dir} already holds a run ({previous}); pass --resume to continue it, "
                    f"or --overwrite to move it aside (to {output_dir / PREVIOUS_NAME}/) and start again, or {_CHOOSE}"
                )
            aside = _move_run_aside(output_dir)
            log(f"--overwrite: moved the previous run in {output_dir} ({previous}) to {aside}")
    except BaseException:
        lock.release()
        raise
    return lock


def claim_on_every_rank(
    output_dir: Path,
    dist: Distributed | None,
    *,
    resume: bool,
    overwrite: bool,
    log: Callable[[str], None],
    config: RunConfig | None = None,
    allow_config_change: bool = False,
) -> RunLock | None:
    """Rank 0 (the one process, without torchrun) claims ``output_dir`` (`claim_output_dir`); every rank learns the
    outcome: a refusal ends them all. The lock (``None`` on the other ranks)."""
    lock, error = None, None
    if dist is None or dist.is_main:
        try:
            lock = claim_output_dir(
                output_dir,
                resume=resume,
                overwrite=overwrite,
                log=log,
                config=config,
                allow_config_change=allow_config_change,
            )
        except VlmregError as exc:
            error = exc
    raise_on_every_rank(dist, error, VlmregError)
    return lock


def write_lora_targets(output_dir: Path, report: Any) -> None:
    """``lora_targets.json``: exactly which modules and parameters got adapters (``report``: the load's LoRA report)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "lora_targets.json").write_text(
        json.dumps(
            {
                "targets": report.targets,
                "modules": list(report.modules),
                "parameters": list(report.parameters),
                "trainable_parameters": report.trainable_parameters,
            },
            indent=2,
        )
    )
