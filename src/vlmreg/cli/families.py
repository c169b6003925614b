"""``vlmreg families`` and ``vlmreg show FAMILY``: what the installed plugins register."""

from __future__ import annotations

import argparse
from typing import Any

from vlmreg.sdk.registry import get_registry


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("families", help="list the installed model families")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(run=run_families)
    p = sub.add_parser("show", help="show everything a family's descriptor says")
    p.add_argument("family", help="family name, e.g. from `vlmreg families`")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(run=run_show)


def family_record(name: str) -> dict[str, Any]:
    """A family's descriptor summary plus the distribution that registered it."""
    registry = get_registry()
    plugin = registry.plugin_of(name)
    return {
        **registry.get(name).summary(),
        "plugin": plugin.distribution or plugin.name,
        "plugin_version": plugin.version,
        "entry_point": plugin.entry_point,
    }


def run_families(args: argparse.Namespace) -> int:
    registry = get_registry()
    records = [family_record(name) for name in registry.names()]
    if args.json:
        # deferred: start-up cost (loads rich)
        from vlmreg.cli.output import print_json  # noqa: PLC0415

        print_json(records)
        return 0
    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import escape, stdout  # noqa: PLC0415

    if not records:
        stdout.print("No model families are installed. Install a family plugin (see docs/tutorial.md).")
        return 0
    for r in records:
        stdout.print(
            f"[bold]{r['name']}[/]  [dim]from {escape(r['plugin'])} {escape(r['plugin_version'] or '')}[/]\n"
            f"  model types    {', '.join(r['model_types'])}\n"
            f"  vision encoder {escape(r['vision_encoder_attr'])}\n"
            f"  language model {escape(r['language_model_attr'])}   lm_head {escape(r['lm_head_attr'])}\n"
            f"  weight prefix  {escape(r['weight_prefix'])}\n"
            f"  images/message {r['max_images_per_message']}   processor {escape(r['vision_processor_id'] or '-')}",
            soft_wrap=True,
        )
    stdout.print(f"[dim]{len(records)} families. `vlmreg show FAMILY` for everything a family declares.[/]")
    return 0


def run_show(args: argparse.Namespace) -> int:
    record = family_record(args.family)
    if args.json:
        # deferred: start-up cost (loads rich)
        from vlmreg.cli.output import print_json  # noqa: PLC0415

        print_json(record)
        return 0
    # deferred: start-up cost (loads rich)
    from rich.table import Table  # noqa: PLC0415

    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import escape, stdout  # noqa: PLC0415

    stdout.print(
        f"[bold]{escape(record['name'])}[/]  from {escape(record['plugin'])} {escape(record['plugin_version'] or '')}",
        soft_wrap=True,
    )
    if record["description"]:
        stdout.print(escape(record["description"]))
    fields = Table(show_header=False, box=None, pad_edge=False)
    fields.add_column(style="cyan")
    fields.add_column(overflow="fold")
    skip = {"name", "description", "lora_presets", "thinking_modes", "plugin", "plugin_version"}
    for key, value in record.items():
        if key in skip:
            continue
        if isinstance(value, (list, tuple)):
            value = ", ".join(map(str, value)) or "-"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items()) or "-"
        fields.add_row(key, escape("-" if value is None else str(value)))
    stdout.print(fields)
    presets = Table(title="LoRA presets", title_justify="left")
    for column in ("preset", "scopes", "modules", "parameters"):
        presets.add_column(column, overflow="fold")
    for name, preset in record["lora_presets"].items():
        default = " (default)" if name == record["default_lora_preset"] else ""
        presets.add_row(
            name + default,
            ", ".join(preset["scopes"]),
            ", ".join(preset["modules"]),
            ", ".join(preset["parameters"]) or "-",
        )
    stdout.print(presets)
    if record["thinking_modes"]:
        modes = Table(title="Thinking modes", title_justify="left")
        for column in ("mode", "chat template kwargs", "checkpoints"):
            modes.add_column(column, overflow="fold")
        for mode in record["thinking_modes"]:
            default = " (default)" if mode["name"] == record["default_thinking_mode"] else ""
            kwargs = ", ".join(f"{k}={v!r}" for k, v in mode["chat_template_kwargs"].items()) or "-"
            modes.add_row(mode["name"] + default, escape(kwargs), escape(", ".join(mode["checkpoints"]) or "all"))
        stdout.print(modes)
    return 0
