"""The files of a plugin skeleton, rendered from a `FamilyLayout` and a `ConfigSpec`.

Every value the author must check or fill in carries the marker `TODO`, so ``grep -rn "TODO(vlmreg new-family)"``
lists the work left.
"""

from __future__ import annotations

import json

from vlmreg.scaffold.discover import FamilyLayout
from vlmreg.scaffold.shrink import ConfigSpec, Field

__all__ = ["TODO", "distribution_name", "render_plugin"]

TODO = "TODO(vlmreg new-family)"


def distribution_name(name: str) -> str:
    """``vlmreg-<name>`` with ``-`` for ``_``, as the bundled plugins are named."""
    return "vlmreg-" + name.replace("_", "-")


def py(value: object) -> str:
    """``value`` as Python source, strings in double quotes (the style of the bundled plugins)."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(py(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{py(k)}: {py(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _field_lines(fields: tuple[Field, ...], indent: str, quote_keys: bool) -> list[str]:
    lines = []
    for f in fields:
        key = f"{py(f.key)}: " if quote_keys else f"{f.key}="
        line = f"{indent}{key}{py(f.value)},"
        lines.append(f"{line}  # {TODO}: {f.note}" if f.note else line)
    return lines


def _tiny_config_source(spec: ConfigSpec) -> str:
    lines = [f"    return {spec.config_class}("]
    for name, model_type, fields in spec.sub_configs:
        lines.append(f"        {name}={{")
        if model_type:
            lines.append(f'            "model_type": {py(model_type)},')
        lines += _field_lines(fields, "            ", quote_keys=True)
        lines.append("        },")
    lines += _field_lines(spec.top, "        ", quote_keys=False)
    lines.append("    )")
    return "\n".join(lines)


def _presets(layout: FamilyLayout) -> str:
    language = "LANGUAGE" if layout.language_linear else '("all-linear",)'
    experts = ", parameters=EXPERTS" if layout.language_expert_parameters else ""
    lines = [
        (
            f'            "language": LoraPreset(modules={language}{experts}, description="the linear layers of the '
            'decoder"),'
        )
    ]
    if layout.connector_linear or layout.connector_parameters:
        modules = f"(*{language}, *CONNECTOR)" if layout.connector_linear else language
        parameters = [
            *(["*EXPERTS"] if experts else []),
            *(["*CONNECTOR_PARAMETERS"] if layout.connector_parameters else []),
        ]
        params = f", parameters=({', '.join(parameters)},)" if parameters else ""
        lines.append(
            f'            "language+projector": LoraPreset(\n'
            f'                modules={modules}{params}, scopes=("language_model", "connectors"),\n'
            f'                description="the decoder layers and the projector",\n'
            f"            ),"
        )
    scopes = py(
        ("language_model", "vision_encoder", "connectors")
        if layout.connector_attrs
        else ("language_model", "vision_encoder")
    )
    extra = ", parameters=CONNECTOR_PARAMETERS" if layout.connector_parameters else ""
    lines.append(
        f'            "all-linear": LoraPreset(modules=("all-linear",){extra}, scopes={scopes}, '
        f'description="every nn.Linear, vision tower included"),'
    )
    return "\n".join(lines)


def render_init(
    name: str,
    model_type: str,
    layout: FamilyLayout,
    spec: ConfigSpec,
    processor_class: str | None,
    bidirectional: bool,
    versions: tuple[str, str],
) -> str:
    vlmreg_version, transformers_version = versions
    major, minor = (transformers_version.split(".") + ["0"])[:2]
    module = f"vlmreg_{name}"
    processor_hint = (
        f"transformers' processor for this type is ``{processor_class}``: build one from it with a small word-level "
        "tokenizer made in code and the PIL image processor (see docs/tutorial.md, step 8)"
        if processor_class
        else "transformers maps no processor class to this type: write the smallest correct processor yourself"
    )
    constants = [f"LANGUAGE = {py(layout.language_linear)}"]
    if layout.language_expert_parameters:
        constants.append(
            f"EXPERTS = {py(layout.language_expert_parameters)}  # fused expert weights: LoRA reaches them as "
            "parameters"
        )
    if layout.connector_linear:
        constants.append(f"CONNECTOR = {py(layout.connector_linear)}")
    if layout.connector_parameters:
        constants.append(f"CONNECTOR_PARAMETERS = {py(layout.connector_parameters)}  # matrices outside any nn.Linear")
    notes = "".join(f"\n- Found: {note}." for note in layout.notes)
    packing = (
        f"        packing=False,  # {TODO}: the text config asks for bidirectional attention (over image tokens?), "
        "which a packed row cannot express; keep False unless the packed parity check passes with True"
        if bidirectional
        else f"        packing=True,  # {TODO}: set False if image tokens attend bidirectionally (the packed parity "
        "check says)"
    )
    connector_line = f"        connector_attrs={py(layout.connector_attrs)},"
    if not layout.connector_attrs:
        connector_line += f"  # {TODO}: none found next to the vision tower; name the projector if it sits inside it"
    blocks = f'"{layout.vision_blocks_attr}"' if layout.vision_blocks_attr else "None"
    return f'''"""The {name} family for vlmreg (``{layout.model_class}``, model_type ``{model_type}``).

Written by ``vlmreg new-family {name} --from-model-type {model_type}`` (vlmreg {vlmreg_version}, transformers
{transformers_version}). The paths in the descriptor were found on the module tree of ``{layout.model_class}``, built
on the meta device from the default config of ``{model_type}``; ``tiny_config`` is that config with small sizes.

What works before any edit: the family registers, its tiny model builds and resolves strictly (every path, the weight
prefix, every LoRA preset; also on the meta device), so ``vlmreg check --tiny {name} --no-parity`` passes. What needs
you, marked ``{TODO}`` below (``grep -rn "{TODO}" src``):

- ``tiny_processor``: the conformance suite and ``vlmreg check --tiny {name}`` feed images through it. {processor_hint}.
  Then make ``tiny_config`` agree with it: the vocabulary size, the token ids, the image and patch sizes.
- ``vision_processor_id`` / ``vision_processor_ids``: the processor of the checkpoints you train.
- ``image_placeholder``, ``turn_end_tokens``, ``max_images_per_message``, ``packing``: what the chat template
  renders for an image, the token closing an assistant turn, how many images a message may carry, and whether
  packing is exact (the conformance suite checks each).{notes}
"""

from __future__ import annotations

from typing import Any

from vlmreg import FamilyDescriptor, LoraPreset, hookimpl

__version__ = "0.1.0"

{chr(10).join(constants)}


def tiny_config() -> Any:
    """A tiny ``{spec.config_class}`` of the real architecture (transformers is imported here, not at plugin load)."""
    from transformers import {spec.config_class}

{_tiny_config_source(spec)}


def descriptor() -> FamilyDescriptor:
    return FamilyDescriptor(
        name="{name}",
        model_types=("{model_type}",),
        vision_encoder_attr="{layout.vision_encoder_attr}",
        language_model_attr="{layout.language_model_attr}",
        layers_attr="{layout.layers_attr}",
        lm_head_attr="{layout.lm_head_attr}",
{connector_line}
        vision_blocks_attr={blocks},
        tiny_config=tiny_config,
        # A zero-argument function returning a processor that works offline (nothing downloaded), e.g. one defined
        # in {module}/processor.py and imported inside a wrapper here; until then the checks that need one fail.
        tiny_processor=None,  # {TODO}: your tiny offline processor (docs/tutorial.md, step 8)
        lora_presets={{
{_presets(layout)}
        }},
        default_lora_preset="language",
        vision_processor_id=None,  # {TODO}: the Hub id of the processor published with your checkpoints
        vision_processor_ids={{}},  # {TODO}: checkpoint patterns -> processor ids, e.g. {{"*-7b-*": "org/model-7b"}}
        image_placeholder=None,  # {TODO}: the text the chat template renders for an image, if it is not the image token
        turn_end_tokens=(),  # {TODO}: the token closing an assistant turn, if it is not the tokenizer's eos
        max_images_per_message=1,  # {TODO}: how many images one message may carry
{packing}
        transformers_range=">={major}.{minor},<{int(major) + 1}",
        description="{layout.model_class} (model_type {model_type}), written by vlmreg new-family",
    )


@hookimpl
def vlmreg_register_families(register):
    register(descriptor())
'''


def render_plugin(
    name: str,
    model_type: str,
    layout: FamilyLayout,
    spec: ConfigSpec,
    processor_class: str | None,
    bidirectional: bool,
    versions: tuple[str, str],
) -> dict[str, str]:
    """The skeleton's files, relative path -> text."""
    dist = distribution_name(name)
    module = f"vlmreg_{name}"
    camel = "".join(part.capitalize() for part in name.split("_"))
    return {
        "pyproject.toml": f'''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "vlmreg family plugin: {layout.model_class} (model_type {model_type})"
requires-python = ">=3.11"
dependencies = ["vlmreg>={versions[0]}"]

[project.entry-points.vlmreg]
{name} = "{module}"

[tool.setuptools.packages.find]
where = ["src"]
''',
        f"src/{module}/__init__.py": render_init(
            name, model_type, layout, spec, processor_class, bidirectional, versions
        ),
        f"tests/test_{name}.py": f'''"""The {name} family against `vlmreg.testing.FamilyConformance`.

Before the fields marked {TODO} in src/{module}/__init__.py are filled in, the structural checks pass
(registration, tiny config, strict resolution, weight prefix, meta device) and the ones that need a processor fail,
each saying so.
"""

from vlmreg.testing import FamilyConformance


class Test{camel}Conformance(FamilyConformance):
    family = "{name}"
    distribution = "{dist}"
''',
        "README.md": f"""# {dist}

The `{name}` family for vlmreg: `{layout.model_class}` (model_type `{model_type}`). Written by
`vlmreg new-family {name} --from-model-type {model_type}`.

```bash
pip install -e .
vlmreg families                          # {name}  from {dist} 0.1.0
vlmreg check --tiny {name} --no-parity   # resolves before any edit
grep -rn "{TODO}" src                     # what is left to fill in
pytest tests                              # the conformance suite
```
""",
    }
