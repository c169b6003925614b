"""``vlmreg new-family NAME --from-model-type TYPE [--output DIR]``: write a plugin skeleton that already resolves.

The descriptor's paths are found on the real transformers class of TYPE, built on the meta device from its default
config (`vlmreg.scaffold.discover`); the tiny config is that config shrunk (`vlmreg.scaffold.shrink`). Before
anything is written the skeleton's own descriptor is resolved strictly on its tiny model, on the meta device; after,
the command lists the fields left for the author (marked ``TODO(vlmreg new-family)``). torch and transformers are
imported only when the command runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

from vlmreg import __version__
from vlmreg.sdk.errors import ResolutionError, UnknownFamilyError, VlmregError
from vlmreg.sdk.registry import get_registry

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("new-family", help="write a plugin skeleton for a new family, its paths found on the real class")
    p.add_argument("name", help="the family's name, a lower-case Python identifier (the module is vlmreg_NAME)")
    p.add_argument(
        "--from-model-type",
        required=True,
        metavar="TYPE",
        help="the model_type of the checkpoints' config.json, as transformers names it",
    )
    p.add_argument("--output", default=".", metavar="DIR", help="where to write the vlmreg-NAME folder (default: here)")
    p.set_defaults(run=run)


def check_name(name: str) -> None:
    """Refuse a NAME that cannot be a module name, or that an installed plugin already registers."""
    if not _NAME.match(name) or not name.isidentifier():
        raise VlmregError(
            f"family name {name!r} is not a lower-case Python identifier (letters, digits and '_', starting with a "
            "letter): the plugin's module is vlmreg_NAME. Try "
            f"{re.sub(r'[^a-z0-9_]', '_', name.lower()).strip('_') or 'my_family'!r}."
        )

    registry = get_registry()
    if name in registry:
        plugin = registry.plugin_of(name)
        raise VlmregError(
            f"family {name!r} is already registered by {plugin.distribution or plugin.name}; pick another name"
        )


def check_model_type_unclaimed(model_type: str) -> None:
    try:
        owner = get_registry().for_model_type(model_type)
    except UnknownFamilyError:
        return
    raise VlmregError(
        f"model type {model_type!r} is already claimed by the installed family {owner.name!r} (`vlmreg show "
        f"{owner.name}`); two families claiming one model type cannot be installed together"
    )


def _load_written(init: Path, name: str) -> Any:
    """Import the written ``__init__.py`` under a private name (not in sys.modules) and return its descriptor."""
    spec = importlib.util.spec_from_file_location(f"_vlmreg_new_family_{name}", init)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.descriptor()


def write_skeleton(name: str, model_type: str, output: str | Path) -> tuple[Path, Any, Any]:
    """Write ``vlmreg-NAME/`` under ``output``; returns the folder, the layout found and the resolved tiny family."""
    # deferred: `vlmreg` starts without it (tempfile)
    import tempfile  # noqa: PLC0415

    # deferred: start-up cost (loads transformers)
    import transformers  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (ast, vlmreg.scaffold, vlmreg.scaffold.discover, ...)
    from vlmreg.scaffold import (  # noqa: PLC0415
        build_on_meta,
        check_model_type,
        distribution_name,
        find_layout,
        render_plugin,
        tiny_config_spec,
    )

    check_name(name)
    check_model_type(model_type)
    check_model_type_unclaimed(model_type)
    folder = Path(output) / distribution_name(name)
    if folder.exists():
        raise VlmregError(f"{folder} already exists; remove it or pass another --output")

    # deferred: start-up cost (loads transformers)
    from transformers import AutoConfig  # noqa: PLC0415
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES  # noqa: PLC0415

    default = AutoConfig.for_model(model_type)
    layout = find_layout(build_on_meta(default))
    spec = tiny_config_spec(model_type)
    text = getattr(default, "text_config", None) or default
    bidirectional = bool(getattr(text, "use_bidirectional_attention", False))
    processor = PROCESSOR_MAPPING_NAMES.get(model_type)
    files = render_plugin(
        name,
        model_type,
        layout,
        spec,
        processor if isinstance(processor, str) else None,
        bidirectional,
        (__version__, transformers.__version__),
    )
    # Resolve the skeleton's own descriptor on its own tiny model before writing anything.
    with tempfile.TemporaryDirectory() as scratch:
        init = Path(scratch) / "__init__.py"
        init.write_text(files[f"src/vlmreg_{name}/__init__.py"])
        descriptor = _load_written(init, name)
    resolved = _resolve_tiny(descriptor)
    folder.mkdir(parents=True)
    for relative, content in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return folder, layout, resolved


def _resolve_tiny(descriptor: Any) -> Any:
    # deferred: start-up cost (loads torch)
    from vlmreg.loading.build import build_model, tiny_config_of  # noqa: PLC0415
    from vlmreg.resolution import resolve  # noqa: PLC0415

    try:
        model = build_model(tiny_config_of(descriptor), descriptor, device="meta")
        return resolve(model, family=descriptor)
    except (ResolutionError, VlmregError) as exc:
        raise VlmregError(
            f"the skeleton for {descriptor.name!r} does not resolve on its own tiny model, so nothing was written: "
            f"{exc}. Please report this with the model type."
        ) from exc


def run(args: argparse.Namespace) -> int:
    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import escape, stdout  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (ast, vlmreg.scaffold, vlmreg.scaffold.discover, ...)
    from vlmreg.scaffold import TODO  # noqa: PLC0415

    folder, layout, resolved = write_skeleton(args.name, args.from_model_type, args.output)
    todos = [
        (
            path.relative_to(folder),
            number,
            line.split("#", 1)[0].strip().rstrip(","),
            line.split(TODO, 1)[1].lstrip(": ").strip(),
        )
        for path in sorted(folder.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if f"# {TODO}" in line
    ]
    d = resolved.descriptor
    stdout.print(f"[bold green]wrote[/] {escape(str(folder))}/", soft_wrap=True)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            stdout.print(f"  {escape(str(path.relative_to(folder)))}")
    stdout.print(f"found on {layout.model_class} (meta device, default config of {args.from_model_type!r}):")
    for field, value in (
        ("vision_encoder_attr", d.vision_encoder_attr),
        ("language_model_attr", d.language_model_attr),
        (
            "decoder layers",
            f"{d.layers_path} ({layout.num_layers} in the default config), weight prefix {d.weight_prefix}",
        ),
        ("lm_head_attr", d.lm_head_attr),
        ("connector_attrs", ", ".join(d.connector_attrs) or "none"),
        ("vision_blocks_attr", d.vision_blocks_attr or "none"),
        (
            "lora presets",
            ", ".join(f"{n} ({sum(t.matches.values())} matches)" for n, t in resolved.lora_presets.items()),
        ),
    ):
        stdout.print(f"  {field:20} {escape(str(value))}", soft_wrap=True)
    stdout.print(
        f"[bold green]ok[/] the tiny model ({len(resolved.layers)} decoder layers) resolves strictly with these paths"
    )
    stdout.print(f"left for you ({len(todos)} fields marked {TODO}):")
    for path, number, code, note in todos:
        stdout.print(f"  {escape(str(path))}:{number}  [cyan]{escape(code)}[/]  {escape(note)}", soft_wrap=True)
    stdout.print(
        f"next: pip install -e {escape(str(folder))} && vlmreg check --tiny {args.name} --no-parity; "
        "after the processor is filled in, vlmreg check --tiny and pytest tests",
        soft_wrap=True,
    )
    sys.stdout.flush()
    return 0
