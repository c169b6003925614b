"""vlmreg.sdk.processor_files: which processor class a checkpoint names, and the chat template transformers picks."""

from __future__ import annotations

import json
import subprocess
import sys

from transformers.utils import hub

from vlmreg.sdk import processor_files


def test_the_file_names_are_transformers_own():
    assert processor_files.CHAT_TEMPLATE_FILE == hub.CHAT_TEMPLATE_FILE
    assert processor_files.CHAT_TEMPLATE_DIR == hub.CHAT_TEMPLATE_DIR
    assert processor_files.LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE == hub.LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE


def test_processor_class_of_reads_processor_config_first(tmp_path):
    assert processor_files.processor_class_of(tmp_path) is None
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"processor_class": "SmolVLMProcessor"}))
    assert processor_files.processor_class_of(tmp_path) == "SmolVLMProcessor"
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Idefics3Processor"}))
    assert processor_files.processor_class_of(tmp_path) == "Idefics3Processor"


def test_importing_it_loads_neither_torch_nor_transformers():
    code = "import sys, vlmreg.sdk.processor_files; print('torch' in sys.modules, 'transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == [
        "False",
        "False",
    ]
