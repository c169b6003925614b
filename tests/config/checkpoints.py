"""Checkpoint directories laid out as real Qwen3-VL ones are (tiny config and processor, real file names).

A real Qwen3-VL checkpoint ships ``config.json``, ``chat_template.json`` (not ``.jinja``),
``preprocessor_config.json`` (flat, naming ``Qwen2VLImageProcessorFast``), ``tokenizer.json`` and
``tokenizer_config.json``, and safetensors weights. Instruct templates end the generation prompt with
``<|im_start|>assistant\\n``; Thinking templates open ``<think>\\n`` after it, always.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from vlmreg.sdk.registry import get_registry

_TURNS = (
    "{%- if messages[0]['role'] != 'system' -%}{{ '<|im_start|>system\\n' + MARK + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}{%- endfor -%}"
)
#: Only these templates write their MARK (a default system turn), so a rendered prompt says which template made it.
INSTRUCT_MARK = "Qwen3-VL Instruct template"
THINKING_MARK = "Qwen3-VL Thinking template"
INSTRUCT_TEMPLATE = (
    "{%- set MARK = '"
    + INSTRUCT_MARK
    + "' -%}"
    + _TURNS
    + "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
THINKING_TEMPLATE = (
    "{%- set MARK = '"
    + THINKING_MARK
    + "' -%}"
    + _TURNS
    + "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif -%}"
)
MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]


def tiny_processor_files(directory: Path) -> None:
    """The bundled tiny processor's files, rewritten to a real Qwen3-VL checkpoint's layout."""
    processor = get_registry().get("qwen3_vl").tiny_processor()
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp)
        processor.save_pretrained(saved)
        image = json.loads((saved / "processor_config.json").read_text())["image_processor"]
        image.update(image_processor_type="Qwen2VLImageProcessorFast", processor_class="Qwen3VLProcessor")
        (directory / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (directory / name).write_bytes((saved / name).read_bytes())


def make_checkpoint(root: Path, name: str, *, model=None, template: str | None = None, processor: bool = True) -> Path:
    """``root/name`` as a real Qwen3-VL checkpoint: config (and weights when ``model`` is given), tokenizer and
    preprocessor files (``processor``), and ``chat_template.json`` (default: Thinking's for ``*-Thinking*``)."""
    directory = root / name
    directory.mkdir(parents=True)
    if model is not None:
        model.save_pretrained(directory)
    else:
        get_registry().get("qwen3_vl").tiny_config().save_pretrained(directory)
    if processor:
        tiny_processor_files(directory)
        if template is None:
            template = THINKING_TEMPLATE if "-Thinking" in name else INSTRUCT_TEMPLATE
        (directory / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2))
    return directory


def fake_hub_cache(cache: Path, repo_id: str, files_from: Path, revision: str = "0123abcd") -> Path:
    """A Hugging Face cache entry for ``repo_id`` holding ``files_from``'s files (``models--org--name/snapshots/REV``,
    ``refs/main``)."""
    org, name = repo_id.split("/")
    repo = cache / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in files_from.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot
