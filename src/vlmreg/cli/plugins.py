"""``vlmreg plugins``: which distributions are loaded, their versions, the hooks they implement and what they
register."""

from __future__ import annotations

import argparse
from typing import Any

from vlmreg.sdk.plugins import ENV_VAR
from vlmreg.sdk.registry import (
    get_engine_registry,
    get_environment_registry,
    get_objective_registry,
    get_plugin_host,
    get_registry,
    get_reward_registry,
    get_sink_registry,
    get_task_registry,
    get_transport_registry,
)

#: JSON key -> the registry whose names it lists, per plugin
REGISTRIES = {
    "families": get_registry,
    "tasks": get_task_registry,
    "objectives": get_objective_registry,
    "rewards": get_reward_registry,
    "rollout_engines": get_engine_registry,
    "metrics_sinks": get_sink_registry,
    "transports": get_transport_registry,
    "environments": get_environment_registry,
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plugins", help="list loaded plugins, their distributions and hooks")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.set_defaults(run=run)


def plugin_records() -> list[dict[str, Any]]:
    host = get_plugin_host()
    registered: dict[str, dict[str, list[str]]] = {}
    for key, get in REGISTRIES.items():
        registry = get()
        for name in registry.names():
            registered.setdefault(registry.plugin_of(name).name, {}).setdefault(key, []).append(name)
    return [
        {
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "entry_point": info.entry_point,
            "hooks": host.hooks_of(info.name),
            **{key: registered.get(info.name, {}).get(key, []) for key in REGISTRIES},
        }
        for info in sorted(host.infos.values(), key=lambda i: i.name)
    ]


def run(args: argparse.Namespace) -> int:
    records = plugin_records()
    if args.json:
        # deferred: start-up cost (loads rich)
        from vlmreg.cli.output import print_json  # noqa: PLC0415

        print_json(records)
        return 0
    # deferred: start-up cost (loads rich)
    from rich.table import Table  # noqa: PLC0415

    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import escape, stdout  # noqa: PLC0415

    if not records:
        stdout.print(f"No vlmreg plugins are loaded (check {ENV_VAR} and the 'vlmreg' entry-point group).")
        return 0
    table = Table(title="vlmreg plugins", title_justify="left")
    for column in ("plugin", "distribution", "version", "hooks", "registers"):
        table.add_column(column, overflow="fold")
    for r in records:
        registers = "; ".join(f"{key}: {', '.join(r[key])}" for key in REGISTRIES if r[key]) or "-"
        cells = (r["name"], r["distribution"] or "(in process)", r["version"] or "-", ", ".join(r["hooks"]), registers)
        table.add_row(*map(escape, cells))  # a plugin's strings are text, not markup
    stdout.print(table)
    return 0
