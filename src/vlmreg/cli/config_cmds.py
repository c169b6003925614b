"""``vlmreg validate CONFIG`` and ``vlmreg config CONFIG --resolved``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_set_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="sets",
        help="override a config value, e.g. --set model.lora.r=8 (repeatable; values are TOML, bare words are strings)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate", help="check a run config against the schema and its model family, every problem at once"
    )
    p.add_argument("config", help="a run config (TOML)")
    p.add_argument(
        "--data",
        action="store_true",
        help="also read every dataset record and image the run would (data.paths, eval.paths), reporting each bad one",
    )
    add_set_option(p)
    p.set_defaults(run=run_validate)
    p = sub.add_parser("config", help="print a run config as vlmreg will use it")
    p.add_argument("config", help="a run config (TOML)")
    p.add_argument("--resolved", action="store_true", help="fill in what the family descriptor knows, marked")
    add_set_option(p)
    p.set_defaults(run=run_config)


def load_resolved(path: str, sets: list[str]):
    # deferred: start-up cost (loads cattrs)
    from vlmreg.config import load_config  # noqa: PLC0415
    from vlmreg.config.resolve import resolve_config  # noqa: PLC0415

    return resolve_config(load_config(path, sets), source=path, sets=sets)


def processor_line(resolved) -> str:
    """Which processor is used and where it came from, in one line (without markup)."""
    source = resolved.processor
    if source is None:
        return "processor: (not resolved)"
    if source.kind == "tiny":
        return f"processor: {source.note}"
    where = (
        "" if source.directory is None or str(source.directory) == source.name else f", loaded from {source.directory}"
    )
    return f"processor: {source.name} (from {source.note}{where})"


def thinking_line(resolved) -> str:
    mode = resolved.thinking_mode
    if mode is None:
        return "thinking mode: none (the checkpoint has no thinking modes)"
    kwargs = ", ".join(f"{k}={v!r}" for k, v in mode.chat_template_kwargs.items())
    how = f"chat template gets {kwargs}" if kwargs else "the checkpoint's own chat template, no arguments"
    return f"thinking mode: {mode.name} ({how})"


def survey_data(validation) -> tuple[list[str], list[str], list[str]]:
    """Read the run's dataset files as training would: (problems, records skipped under on_bad_image, summary lines)."""

    # deferred: start-up cost (loads urllib.request)
    from vlmreg.data.survey import survey_files  # noqa: PLC0415

    config = validation.resolved.config if validation.resolved else validation.parsed.config
    if config is None or not validation.clean("data", "eval"):
        return [], [], ["data: not read ([data] or [eval] has problems above)"]
    family = validation.resolved.family if validation.resolved else None
    base = Path(validation.source).resolve().parent
    splits = [("train", config.data.paths, config.data.num_samples)]
    if config.eval.paths:
        splits.append(("eval", config.eval.paths, config.eval.num_samples))
    problems, skipped, summary = [], [], []
    for split, paths, count in splits:
        if not paths:
            summary.append(f"data ({split}): task {config.data.task} generates its examples; no files to read")
            continue
        survey = survey_files(
            config.data,
            paths,
            base_dir=base,
            num_samples=count,
            max_images_per_message=family.max_images_per_message if family else None,
            family=family.name if family else "",
            max_videos_per_message=family.max_videos_per_message if family else None,
            video_sampling=family.video_sampling if family else None,
        )
        problems += survey.problems
        skipped += survey.skipped
        summary.append(
            f"data ({split}): {survey.records} record{'s' if survey.records != 1 else ''} and {survey.images} "
            f"image{'s' if survey.images != 1 else ''} read from {survey.files} "
            f"file{'s' if survey.files != 1 else ''}: {survey.examples} example{'s' if survey.examples != 1 else ''}"
            + (
                f", {len(survey.skipped)} record{'s' if len(survey.skipped) != 1 else ''} skipped (on_bad_image = "
                '"skip")'
                if survey.skipped
                else ""
            )
        )
    return problems, skipped, summary


def run_validate(args: argparse.Namespace) -> int:
    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import error, escape, stderr, stdout  # noqa: PLC0415

    # deferred: start-up cost (loads cattrs)
    from vlmreg.config.validate import validate_config  # noqa: PLC0415

    validation = validate_config(args.config, args.sets)
    problems, skipped, summary = survey_data(validation) if args.data else ([], [], [])
    if validation.problems or problems:
        # deferred: start-up cost (loads cattrs)
        from vlmreg.config.load import blame_sets  # noqa: PLC0415

        error(str(blame_sets(validation.error(problems), args.sets)))  # a --set's problem is reported against it
        for line in [*skipped, *summary]:
            stderr.print(f"  {escape(line)}", soft_wrap=True)
        return 1
    for line in skipped:
        stderr.print(f"[yellow]warning[/] {escape(line)}", soft_wrap=True)
    resolved = validation.resolved
    assert resolved is not None, "a validation without problems has a resolved config"
    filled = len(resolved.from_family)
    stdout.print(
        f"[bold green]ok[/] {escape(args.config)}: family {resolved.family.name}, "
        f"{filled} value{'s' if filled != 1 else ''} from the family descriptor (`vlmreg config {escape(args.config)} "
        "--resolved` shows them)",
        soft_wrap=True,
    )
    stdout.print(f"  {escape(processor_line(resolved))}", soft_wrap=True)
    stdout.print(f"  {escape(thinking_line(resolved))}", soft_wrap=True)
    for line in summary:
        stdout.print(f"  {escape(line)}", soft_wrap=True)
    return 0


def run_config(args: argparse.Namespace) -> int:
    # deferred: start-up cost (loads cattrs)
    from vlmreg.config import load_config  # noqa: PLC0415
    from vlmreg.config.toml_out import to_toml  # noqa: PLC0415

    if args.resolved:
        resolved = load_resolved(args.config, args.sets)
        marks = dict(resolved.from_family)
        if resolved.processor is not None:
            marks["model.processor"] = resolved.processor.note
        text = to_toml(resolved.config, marks)
        header = (
            f"# {args.config}, resolved against family {resolved.family.name}; '# from ...' marks the values filled "
            f"in\n# {processor_line(resolved)}\n# {thinking_line(resolved)}\n"
        )
    else:
        text = to_toml(load_config(args.config, args.sets))
        header = f"# {args.config}, with defaults\n"
    sys.stdout.write(header + text)
    return 0
