"""``vlmreg check TARGET | --tiny FAMILY``: resolve a family strictly against a real module tree, then parity.

TARGET (a local model directory or config.json) is built on the meta device: no weights are read and
no memory is allocated, so the config of a 235B checkpoint checks in seconds; that needs config.json only. Then the
parity checks of `vlmreg.testing.parity` and `vlmreg.testing.rollout_parity` that need no weights run: with
``--tiny`` all of them (prompt ids and inputs vs the processor, logprobs vs a plain forward alone / padded / packed,
turn-end stop, multi-turn merge, and
the same with videos, or a family without video refusing one);
with a TARGET, the prompt check with the directory's own processor. A directory without a complete processor
(tokenizer files, chat template, preprocessor config) gets a note naming the files looked for instead of that
check, and still exits 0 when the rest holds. Exit 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from vlmreg.cli import check_engine
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_registry


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="resolve a family against a model's real module tree")
    p.add_argument("target", nargs="?", help="a local model directory or config.json")
    p.add_argument("--tiny", metavar="FAMILY", help="check the family's tiny random model instead of a TARGET")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="FIELD=PATH",
        help="override a descriptor path for this model, e.g. language_model_attr=model.text_model (repeatable)",
    )
    p.add_argument("--depth", type=int, default=2, help="module tree depth to print (resolved paths always show)")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument(
        "--no-parity",
        action="store_true",
        help="resolve only; skip the parity checks against the processor and a plain forward",
    )

    check_engine.add_options(p)
    p.set_defaults(run=run)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise VlmregError(
                f"--override {item!r}: expected FIELD=PATH, e.g. language_model_attr=model.language_model"
            )
        key, value = key.strip(), value.strip()
        overrides[key] = [v.strip() for v in value.split(",") if v.strip()] if key == "connector_attrs" else value
    return overrides


def run(args: argparse.Namespace) -> int:
    if args.engine is not None:  # engine parity: `vlmreg.cli.check_engine`
        return check_engine.run(args)
    if (args.target is None) == (args.tiny is None):
        raise VlmregError("check takes either a TARGET (model directory or config.json) or --tiny FAMILY")
    overrides = parse_overrides(args.override)
    started = time.perf_counter()

    # deferred: start-up cost (loads torch)
    from vlmreg.loading.build import build_model, load_config, read_model_type, tiny_config_of  # noqa: PLC0415
    from vlmreg.resolution import resolve  # noqa: PLC0415

    registry = get_registry()
    if args.tiny:
        descriptor = registry.get(args.tiny)
        model = build_model(tiny_config_of(descriptor), descriptor)
        source = f"tiny {descriptor.name} (random init, CPU)"
    else:
        descriptor = registry.for_model_type(read_model_type(args.target))
        config = load_config(args.target)
        model = build_model(config, descriptor, device="meta")
        source = f"{args.target} (meta device, no weights read)"
    resolved = resolve(model, overrides, family=descriptor)
    seconds = time.perf_counter() - started

    summary = {"source": source, "ok": True, "seconds": round(seconds, 3), **resolved.summary()}
    parity, notes = ([], []) if args.no_parity else _parity(descriptor, args.target)
    summary["packing"] = descriptor.packing
    summary["parity"] = [r.as_dict() for r in parity]
    summary["notes"] = notes
    summary["ok"] = all(r.ok for r in parity)
    if args.json:
        # deferred: start-up cost (loads rich)
        from vlmreg.cli.output import print_json  # noqa: PLC0415

        print_json(summary)
    else:
        _print_human(resolved, summary, args.depth)
        _print_parity(parity, notes, descriptor)
    return 0 if summary["ok"] else 1


def _parity(descriptor: Any, target: str | None) -> tuple[list[Any], list[str]]:
    """The parity checks that need no weights, and notes on those that could not run: all of them on the tiny model,
    the prompt check with a TARGET's own processor when its directory holds every processor file."""

    # deferred: start-up cost (loads cattrs)
    from vlmreg.config.resolve import missing_processor_files  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (functools, random, vlmreg.testing, ...)
    from vlmreg.testing import parity  # noqa: PLC0415

    if target is None:  # the tiny model: every check, the video ones (or the refusal of a video) last
        # deferred: start-up cost (loads torch)
        from vlmreg.testing.rollout_parity import parity_report  # noqa: PLC0415
        from vlmreg.testing.video_parity import video_parity_report  # noqa: PLC0415

        return [*parity_report(descriptor.name), *video_parity_report(descriptor.name)], []
    path = Path(target)
    directory = path if path.is_dir() else path.parent
    missing = missing_processor_files(directory, descriptor.supports_vision)
    if missing:
        return [], [_missing_note(descriptor, directory, missing)]
    name = "prompt, the checkpoint's processor"
    try:
        if descriptor.load_processor is not None:
            processor = descriptor.load_processor(directory)
        else:
            # deferred: start-up cost (loads transformers)
            from transformers import AutoProcessor  # noqa: PLC0415

            processor = AutoProcessor.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # transformers' or the plugin's own errors: the processor files are there but do not load
        return [
            parity.Parity(name, False, f"loading the processor of {directory} failed: {type(exc).__name__}: {exc}")
        ], []
    try:
        return parity.prompt_parity(descriptor.name, processor=processor), []
    except VlmregError as exc:  # e.g. a turn-end token this tokenizer does not have
        return [parity.Parity(name, False, f"{directory}: {exc}")], []


def _missing_note(descriptor: Any, directory: Any, missing: list[str]) -> str:
    """What a checkpoint directory lacks for the prompt check, and where `vlmreg train` would take a processor from."""
    # deferred: start-up cost (loads cattrs)
    from vlmreg.config.resolve import PROCESSOR_FILES  # noqa: PLC0415

    lacks = f"{directory} lacks {'; '.join(missing)}, so the prompt check against its processor did not run"
    if any((directory / f).is_file() for f in PROCESSOR_FILES):
        return (
            f"{lacks}. Training from it needs them (copy them from the base checkpoint) or model.processor naming "
            "a directory that has them"
        )
    processor_id = descriptor.processor_id_for(str(directory))
    if processor_id is None:
        return (
            f"{lacks}. It has no processor files at all: training from it needs model.processor (family "
            f"{descriptor.name} names none)"
        )
    return (
        f"{lacks}. It has no processor files at all: training from it takes family {descriptor.name}'s processor "
        f"{processor_id!r} unless model.processor names one"
    )


def _print_parity(results: list[Any], notes: list[str], descriptor: Any) -> None:
    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import escape, stdout  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (vlmreg.testing)
    from vlmreg.testing.hints import contract_hint  # noqa: PLC0415

    for r in results:
        mark = "[green]ok[/]  " if r.ok else "[bold red]FAIL[/]"
        stdout.print(f"{mark} {escape(r.name)}: {escape(r.detail)}", soft_wrap=True)
        if not r.ok and contract_hint(r.name):
            stdout.print(f"     hint: {escape(contract_hint(r.name))}", soft_wrap=True)
    for note in notes:
        stdout.print(f"[yellow]note[/] {escape(note)}", soft_wrap=True)
    verdict = (
        "packed rows (block-diagonal per sample)"
        if descriptor.packing
        else "padded micro-batches (the family declares packing=False)"
    )
    stdout.print(f"training batches: {verdict}")


def _print_human(resolved: Any, summary: dict[str, Any], depth: int) -> None:
    # deferred: start-up cost (loads rich)
    from rich.table import Table  # noqa: PLC0415

    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import escape, stdout  # noqa: PLC0415

    # deferred: start-up cost (loads rich, torch)
    from vlmreg.cli.tree import module_tree  # noqa: PLC0415

    d = resolved.descriptor
    marks = {
        d.vision_encoder_attr: "vision_encoder_attr",
        d.language_model_attr: "language_model_attr",
        d.layers_path: f"decoder layers, weight prefix {d.weight_prefix}",
        d.lm_head_attr: "lm_head_attr",
        **{path: "connector" for path in d.connector_attrs},
    }
    if d.vision_blocks_attr:
        marks[f"{d.vision_encoder_attr}.{d.vision_blocks_attr}"] = "vision blocks"
    stdout.print(module_tree(resolved.model, marks, depth))
    table = Table(title="LoRA presets on this model", title_justify="left")
    for column in ("preset", "modules", "parameters", "matches per pattern", "reaches vision"):
        table.add_column(column, overflow="fold")
    for name, targets in resolved.lora_presets.items():
        matches = ", ".join(f"{p}: {n}" for p, n in targets.matches.items())
        table.add_row(
            name,
            str(len(targets.modules)),
            str(len(targets.parameters)),
            escape(matches),
            "yes" if targets.reaches_vision else "no",
        )
    stdout.print(table)
    stdout.print(
        f"[bold green]ok[/] family [bold]{resolved.name}[/] resolves on {escape(summary['source'])}: "
        f"{summary['num_layers']} decoder layers under {escape(d.weight_prefix)}, "
        f"{len(d.connector_attrs)} connector(s), {len(resolved.lora_presets)} LoRA presets ({summary['seconds']:.2f} "
        "s)",
        soft_wrap=True,
    )
