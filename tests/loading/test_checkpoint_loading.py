"""Chat templates are found where transformers finds them, and real-looking checkpoints (a directory, or a Hub id in
the local cache) load with their own processor and thinking mode."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from vlmreg_qwen_common.processor import load_processor

import vlmreg
from tests.config.checkpoints import (
    MESSAGES,
    THINKING_MARK,
    THINKING_TEMPLATE,
    fake_hub_cache,
    make_checkpoint,
    tiny_processor_files,
)
from vlmreg.config import parse_config
from vlmreg.sdk.processor_files import chat_template_of
from vlmreg.testing import tiny_model


def transformers_template(directory):
    """What transformers' `ProcessorMixin.from_pretrained` would give the processor as its chat template."""

    return Qwen3VLProcessor.get_processor_dict(str(directory), local_files_only=True)[0].get("chat_template")


LAYOUTS = {
    "jinja only": {"chat_template.jinja": "J"},
    "json only": {"chat_template.json": json.dumps({"chat_template": "S"})},
    "json wins over jinja": {"chat_template.jinja": "J", "chat_template.json": json.dumps({"chat_template": "S"})},
    "processor_config wins": {
        "chat_template.json": json.dumps({"chat_template": "S"}),
        "processor_config.json": json.dumps({"chat_template": "P", "image_processor": {}}),
    },
    "named templates": {"chat_template.jinja": "J", "additional_chat_templates/tool_use.jinja": "T"},
    "none": {},
}


@pytest.mark.parametrize("files", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_the_chat_template_is_the_one_transformers_picks(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert chat_template_of(tmp_path) == transformers_template(tmp_path)


def test_a_legacy_json_beside_named_templates_is_refused_as_transformers_does(tmp_path):
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "S"}))
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "x.jinja").write_text("X")
    with pytest.raises(ValueError, match="conflicting files"):
        transformers_template(tmp_path)
    with pytest.raises(ValueError, match="chat_template.json and additional_chat_templates/ both hold templates"):
        chat_template_of(tmp_path)


def test_without_a_processor_template_the_tokenizers_is_used(tmp_path):
    tiny_processor_files(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "from the tokenizer"}))
    assert chat_template_of(tmp_path) is None
    assert (
        load_processor(tmp_path).chat_template
        == AutoTokenizer.from_pretrained(tmp_path).chat_template
        == "from the tokenizer"
    )
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "from chat_template.json"}))
    assert load_processor(tmp_path).chat_template == "from chat_template.json"


@pytest.fixture(scope="module")
def thinking_model():
    return tiny_model("qwen3_vl")


def test_a_thinking_checkpoint_loads_with_its_template_and_mode(tmp_path, thinking_model):
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Thinking", model=thinking_model)
    loaded = vlmreg.load(parse_config({"model": {"name": str(directory)}, "trainer": {"device": "cpu"}}))
    assert loaded.config.config.rollout.thinking_mode == "on"
    assert loaded.processor.chat_template == json.loads((directory / "chat_template.json").read_text())["chat_template"]
    prompt = loaded.processor.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, **loaded.config.chat_template_kwargs
    )
    assert THINKING_MARK in prompt and prompt.endswith("<think>\n")
    for (name, a), (_, b) in zip(thinking_model.state_dict().items(), loaded.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_hub_id_loads_from_the_cache_offline(tmp_path, monkeypatch, thinking_model):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    published = make_checkpoint(tmp_path, "src/Qwen3-VL-2B-Thinking", model=thinking_model)
    snapshot = fake_hub_cache(cache, "Qwen/Qwen3-VL-2B-Thinking", published)
    loaded = vlmreg.load(parse_config({"model": {"name": "Qwen/Qwen3-VL-2B-Thinking"}, "trainer": {"device": "cpu"}}))
    assert loaded.config.checkpoint_dir == snapshot and loaded.processor.chat_template == THINKING_TEMPLATE
    assert torch.equal(loaded.model.lm_head.weight, thinking_model.lm_head.weight)
