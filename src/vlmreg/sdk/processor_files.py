"""Reading a checkpoint's processor files without loading them: which processor class they name, which chat template
transformers would pick. For family plugins' ``load_processor`` (processors built without torchvision, where
``AutoProcessor`` cannot be trusted). JSON and text only: no torch, no transformers at import time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["chat_template_of", "processor_class_of"]

#: transformers' own names for these files (``transformers.utils.hub``), repeated so importing this costs nothing.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE = "chat_template.json"


def processor_class_of(directory: str | Path) -> str | None:
    """The ``processor_class`` a checkpoint's processor files name (``processor_config.json`` first, as transformers
    reads them, then ``preprocessor_config.json``); ``None``: neither names one."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = Path(directory) / name
        if path.is_file():
            value = _read_json(path).get("processor_class")
            if value:
                return value
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def chat_template_of(directory: str | Path) -> str | dict[str, str] | None:
    """The processor's chat template in a directory, found as transformers 5's ``ProcessorMixin.from_pretrained``
    finds it: a ``"chat_template"`` in ``processor_config.json``, else ``chat_template.json`` (the legacy file many
    published checkpoints ship; its ``"chat_template"`` key), else ``chat_template.jinja`` with any
    ``additional_chat_templates/*.jinja`` (a dict keyed by name, ``"default"`` for the main one). ``None``: the
    directory has none of these (a loader then falls back to the tokenizer's template, from ``tokenizer_config.json``).
    """
    directory = Path(directory)
    config = directory / "processor_config.json"
    in_config = _read_json(config).get("chat_template") if config.is_file() else None
    if in_config is not None:
        return in_config
    extra_dir = directory / CHAT_TEMPLATE_DIR
    extra = (
        {p.stem: p.read_text(encoding="utf-8") for p in sorted(extra_dir.glob("*.jinja"))} if extra_dir.is_dir() else {}
    )
    legacy = directory / LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE
    if legacy.is_file():
        if extra:
            raise ValueError(
                f"{directory}: {legacy.name} and {CHAT_TEMPLATE_DIR}/ both hold templates; transformers refuses that "
                "too"
            )
        data = _read_json(legacy)
        if not isinstance(data.get("chat_template"), str):
            raise ValueError(f'{legacy}: no "chat_template" string')
        return data["chat_template"]
    raw = directory / CHAT_TEMPLATE_FILE
    if raw.is_file():
        extra["default"] = raw.read_text(encoding="utf-8")
    if list(extra) == ["default"]:
        return extra["default"]
    return extra or None
