"""``vlmreg train CONFIG`` and ``vlmreg eval CONFIG [--checkpoint DIR]``."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from vlmreg.cli.config_cmds import add_set_option, load_resolved
from vlmreg.sdk.errors import VlmregError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a policy by GRPO / GSPO as a run config describes")
    p.add_argument("config", help="a run config (TOML)")
    add_set_option(p)
    p.add_argument(
        "--output-dir", type=Path, help="where metrics, rollouts and checkpoints go (default: trainer.output_dir)"
    )
    again = p.add_mutually_exclusive_group()
    again.add_argument(
        "--resume", action="store_true", help="continue from the last good checkpoint in the output directory"
    )
    again.add_argument(
        "--overwrite",
        action="store_true",
        help="move a previous run in the output directory (metrics, checkpoints, rollouts, tensorboard) aside into "
        "OUTPUT/previous/<UTC timestamp>/ and start again; nothing is deleted",
    )
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue even when the config changes what defines the run (model, objective, group size, "
        "data, reward); other changes are always printed and accepted",
    )
    p.add_argument(
        "--ignore-parity",
        action="store_true",
        help="start even when the family fails the parity checks of `vlmreg check --tiny FAMILY` (each failure is "
        "printed as a warning); without it such a run is refused",
    )
    p.set_defaults(run=run_train)
    p = sub.add_parser("eval", help="score a held-out split with greedy decoding")
    p.add_argument("config", help="a run config (TOML)")
    add_set_option(p)
    p.add_argument(
        "--checkpoint",
        type=Path,
        help="a checkpoint folder (step_NNNNNN) or a run's output directory; default: the initial model",
    )
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(run=run_eval)


class _Progress:
    """Live progress on a terminal; one line per step otherwise (CI logs)."""

    def __init__(self, total: int) -> None:
        # deferred: start-up cost (loads rich)
        from vlmreg.cli.output import stdout  # noqa: PLC0415

        self.console, self.total = stdout, total
        self.live = None
        if stdout.is_terminal:
            # deferred: start-up cost (loads rich)
            from rich.progress import (  # noqa: PLC0415
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.live = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=stdout,
            )
            self.task = self.live.add_task("train", total=total, stats="")
            self.live.start()

    def log(self, message: str) -> None:
        # deferred: start-up cost (loads rich)
        from vlmreg.cli.output import escape  # noqa: PLC0415

        self.console.print(escape(message), soft_wrap=True)

    def step(self, record: dict[str, Any]) -> None:
        stats = (
            f"reward {record['reward_mean']:.3f}  kl {record.get('mismatch_kl', 0.0):.2e}  "
            f"{record['tokens_per_s']:.0f} tok/s"
        )
        if "eval_reward_mean" in record:
            stats += f"  eval {record['eval_reward_mean']:.3f}"
        if self.live is not None:
            self.live.update(self.task, completed=record["step"], stats=stats)
        else:
            self.console.print(
                f"step {record['step']}/{self.total}  {stats}  ({record['step_s']:.2f} s)", soft_wrap=True
            )

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()


def _trainer(args: argparse.Namespace, **kwargs: Any):
    # deferred: start-up cost (loads asyncio, cattrs, concurrent, safetensors, torch, urllib.request)
    from vlmreg.train.recipe import Trainer  # noqa: PLC0415

    rc = load_resolved(args.config, args.sets)
    return Trainer(rc, base_dir=Path(args.config).resolve().parent, **kwargs), rc


def run_train(args: argparse.Namespace) -> int:
    # deferred: start-up cost (loads cattrs)
    # deferred: `vlmreg` starts without it (loads torch, vlmreg.testing)
    from vlmreg.cli.parity_gate import check_family_parity  # noqa: PLC0415
    from vlmreg.train.api import TrainingInterrupted, train  # noqa: PLC0415

    rc = load_resolved(args.config, args.sets)
    progress = _Progress(rc.config.trainer.steps)
    check_family_parity(rc.family, ignore=args.ignore_parity, log=progress.log)
    try:  # the code path of vlmreg.train(...) from Python
        result = train(
            rc,
            output_dir=args.output_dir,
            resume=args.resume,
            overwrite=args.overwrite,
            log=progress.log,
            allow_config_change=args.allow_config_change,
            on_step=progress.step,
            base_dir=Path(args.config).resolve().parent,
        )
    except TrainingInterrupted as exc:
        progress.stop()
        # deferred: start-up cost (loads rich)
        from vlmreg.cli.output import error  # noqa: PLC0415

        error(
            interrupted_message(
                exc.step, exc.output_dir, rc.config.trainer.save_every, getattr(args, "argv", None) or _typed(args)
            )
        )
        return 130
    finally:
        progress.stop()
    if result.main and result.steps_trained:  # with none, the trainer's note said why
        reward = result.final.get("reward_mean", float("nan"))
        progress.log(f"done: step {result.step}, reward {reward:.3f}; metrics in {result.metrics_path}")
    return 0


def _typed(args: argparse.Namespace) -> list[str]:
    """The words of a ``vlmreg train`` command with ``args`` (when the words typed are not known)."""
    words = ["train", args.config]
    for item in args.sets:
        words += ["--set", item]
    if args.output_dir is not None:
        words += ["--output-dir", str(args.output_dir)]
    words += (
        ["--resume"] * args.resume
        + ["--overwrite"] * args.overwrite
        + ["--allow-config-change"] * args.allow_config_change
        + ["--ignore-parity"] * getattr(args, "ignore_parity", False)
    )
    return words


# shortest abbreviation
_FLAGS = {"resume": ("--resume", 3), "overwrite": ("--overwrite", 4), "allow": ("--allow-config-change", 3)}


def _is(word: str, name: str) -> bool:
    """``word`` is the flag ``name`` names, or an abbreviation argparse takes for it."""
    flag, shortest = _FLAGS[name]
    return len(word) >= shortest and flag.startswith(word)


def rerun_command(argv: list[str], *, resume: bool, overwrite: bool = False) -> str:
    """``vlmreg ARGV``, the words as typed, quoted for a shell: with ``--resume`` (and without ``--overwrite``, which
    contradicts it), or, for a fresh start, without ``--resume`` and ``--allow-config-change`` and with
    ``--overwrite`` when ``overwrite``."""
    end = argv.index("--") if "--" in argv else len(argv)  # options end there
    head, tail = argv[:end], argv[end:]
    resumed = any(_is(w, "resume") for w in head)  # a resumed run: its --resume stays where it was typed
    drop = ("overwrite",) if resume else ("resume", "overwrite", "allow")
    words = [w for w in head if not any(_is(w, name) for name in drop)]
    extra = ([] if resumed else ["--resume"]) if resume else ["--overwrite"] if overwrite else []
    return shlex.join(["vlmreg", *words, *extra, *tail])


def interrupted_message(step: int, output_dir: Path, save_every: int, argv: list[str]) -> str:
    """What Ctrl-C left: the last step trained, the checkpoint on disk (or that there is none) and the exact command
    that continues the run (or starts it again)."""
    # deferred: start-up cost (loads safetensors, torch)
    from vlmreg.train.checkpoint import latest_checkpoint  # noqa: PLC0415

    # deferred: start-up cost (loads cattrs, safetensors, torch)
    from vlmreg.train.rundir import describe_run  # noqa: PLC0415

    done = f"interrupted after step {step}" if step else "interrupted before the first step"
    checkpoint = latest_checkpoint(output_dir / "checkpoints", log=lambda message: None)
    if checkpoint is not None:
        saved = int(checkpoint.name.removeprefix("step_"))
        lost = (
            ""
            if step <= saved
            else f" (step {step} was not saved)"
            if step == saved + 1
            else f" (steps {saved + 1}-{step} were not saved)"
        )
        return (
            f"{done}; the last checkpoint is step {saved}, {checkpoint}{lost}. Continue from it: "
            f"{rerun_command(argv, resume=True)}"
        )
    cadence = (
        f"trainer.save_every = {save_every}: the first at step {save_every}"
        if save_every
        else "trainer.save_every = 0: only at the end"
    )
    previous = describe_run(output_dir)
    again = rerun_command(argv, resume=False, overwrite=previous is not None)
    return f"{done}; no checkpoint was written ({cadence}), so there is nothing to resume. Start again: {again}"


def _warn(message: str) -> None:
    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import escape, stderr  # noqa: PLC0415

    stderr.print(escape(message), soft_wrap=True)


def run_eval(args: argparse.Namespace) -> int:
    # deferred: start-up cost (loads safetensors, torch)
    from vlmreg.train.checkpoint import checkpoint_steps, load_checkpoint, resume_checkpoint  # noqa: PLC0415

    if args.checkpoint is not None and not args.checkpoint.is_dir():  # before the model loads: a typo fails in a second
        raise VlmregError(f"{args.checkpoint}: no such checkpoint folder or run directory")
    trainer, _ = _trainer(args, writes_output=False)  # eval never touches the run directory of the config
    trainer.log = lambda message: None
    trainer.setup()
    source = "initial model"
    if args.checkpoint is not None:
        path = args.checkpoint
        if (path / "state.json").is_file():  # one checkpoint, named: it loads or the error names the file at fault
            load_checkpoint(path, trainer.model, None)
        else:  # a run directory (or its checkpoints folder): the newest good checkpoint, warning about any skipped
            folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
            if not ((folder / "latest").exists() or checkpoint_steps(folder)):
                raise VlmregError(
                    f"{args.checkpoint}: no checkpoint there (expected a step_NNNNNN folder or a run directory)"
                )
            path, _ = resume_checkpoint(folder, trainer.model, None, log=_warn)
        source = str(path)
    result = {"checkpoint": source, **trainer.evaluate()}
    trainer.cleanup()
    if args.json:
        # deferred: start-up cost (loads rich)
        from vlmreg.cli.output import print_json  # noqa: PLC0415

        print_json(result)
    else:
        # deferred: start-up cost (loads rich)
        from vlmreg.cli.output import stdout  # noqa: PLC0415

        stdout.print(
            f"eval of {source}: reward {result['eval_reward_mean']:.3f} on {int(result['eval_samples'])} held-out "
            "samples (greedy)"
        )
    return 0
