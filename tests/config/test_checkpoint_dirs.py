"""Real-looking Qwen3-VL checkpoint directories resolve and load: thinking modes, chat templates, processor files,
where the processor comes from, and Hub ids through the local Hugging Face cache (offline)."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub
import pytest
from transformers import AutoTokenizer
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from tests.config.checkpoints import (
    INSTRUCT_MARK,
    INSTRUCT_TEMPLATE,
    MESSAGES,
    THINKING_MARK,
    THINKING_TEMPLATE,
    fake_hub_cache,
    make_checkpoint,
    tiny_processor_files,
)
from vlmreg.cli.config_cmds import processor_line
from vlmreg.config import ConfigError, parse_config
from vlmreg.config.resolve import METADATA_FILES, find_checkpoint, missing_processor_files, resolve_config
from vlmreg.loading.load import load_processor
from vlmreg.sdk.errors import VlmregError


def resolve(name, **rollout):
    return resolve_config(parse_config({"model": {"name": str(name)}, "rollout": rollout}))


def render(rc):
    """The generation prompt as the run renders it: the loaded processor's template with the thinking mode's kwargs."""
    processor = load_processor(rc)
    return processor, processor.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False, **rc.chat_template_kwargs
    )


def transformers_template(directory):
    """transformers' own answer: the chat template `ProcessorMixin.from_pretrained` would give this directory."""

    return Qwen3VLProcessor.get_processor_dict(str(directory), local_files_only=True)[0].get("chat_template")


def test_an_instruct_checkpoint_answers_directly_with_its_own_chat_template(tmp_path):
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    rc = resolve(directory)
    assert rc.config.rollout.thinking_mode == "off" and rc.chat_template_kwargs == {}
    assert rc.processor.kind == "checkpoint" and rc.processor.directory == directory
    assert rc.config.model.processor == str(directory) and "model.processor" not in rc.from_family
    processor, prompt = render(rc)
    on_disk = json.loads((directory / "chat_template.json").read_text())["chat_template"]
    assert processor.chat_template == on_disk == transformers_template(directory) == INSTRUCT_TEMPLATE
    assert INSTRUCT_MARK in prompt and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_a_thinking_checkpoint_gets_its_only_mode_on_and_its_template_opens_think(tmp_path):
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Thinking")
    rc = resolve(directory)
    assert rc.config.rollout.thinking_mode == "on" and rc.from_family["rollout.thinking_mode"] == "family qwen3_vl"
    processor, prompt = render(rc)
    assert processor.chat_template == transformers_template(directory) == THINKING_TEMPLATE
    assert THINKING_MARK in prompt and prompt.endswith("<|im_start|>assistant\n<think>\n")
    with pytest.raises(
        ConfigError,
        match="rollout.thinking_mode: 'off' is not available for checkpoint .*Qwen3-VL-2B-Thinking.* \\(available: "
        "on\\)",
    ):
        resolve(directory, thinking_mode="off")


def test_qwen3_5_thinking_modes_reach_the_chat_template(tmp_path):
    """Qwen3.5 thinks or not by enable_thinking: on opens a think block, off closes an empty one (as the real
    template)."""
    base = {"model": {"init": "random", "family": "qwen3_5"}}
    on = resolve_config(parse_config(base))
    off = resolve_config(parse_config({**base, "rollout": {"thinking_mode": "off"}}))
    assert on.chat_template_kwargs == {"enable_thinking": True} and off.chat_template_kwargs == {
        "enable_thinking": False
    }
    head = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour is "
        "it?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(on)[1] == head + "<think>\n"
    assert render(off)[1] == head + "<think>\n\n</think>\n\n"
    vl = resolve_config(parse_config({"model": {"init": "random", "family": "qwen3_vl"}}))
    assert vl.config.rollout.thinking_mode == "off" and render(vl)[1] == head  # a random Qwen3-VL is Instruct-like


@pytest.mark.parametrize(
    ("remove", "named"),
    [
        (["preprocessor_config.json"], ["preprocessor_config.json (or processor_config.json)"]),
        (["tokenizer.json"], ["tokenizer.json (or tokenizer_config.json with vocab.json + merges.txt"]),
        (["tokenizer.json", "tokenizer_config.json"], ["tokenizer.json"]),
        (["chat_template.json"], ["a chat template (chat_template.json, chat_template.jinja"]),
        (["tokenizer.json", "preprocessor_config.json"], ["tokenizer.json", "preprocessor_config.json"]),
    ],
)
def test_missing_processor_files_are_named_with_the_directory(tmp_path, remove, named):
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    for name in remove:
        (directory / name).unlink()
    with pytest.raises(ConfigError) as info:
        resolve(directory)
    [problem] = info.value.problems
    assert problem.startswith(f"model.name: {directory} lacks ")
    assert all(n in problem for n in named)
    kept = {"tokenizer.json", "preprocessor_config.json", "chat_template.json"} - set(remove)
    assert not any(f"lacks {n}" in problem or f"; {n}" in problem for n in kept)


def test_a_vocabulary_needs_its_merges(tmp_path):
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    (directory / "tokenizer.json").unlink()
    (directory / "vocab.json").write_text("{}")
    with pytest.raises(ConfigError, match="lacks merges.txt \\(beside vocab.json\\)"):
        resolve(directory)


def test_a_model_only_save_takes_the_family_processor_for_its_name_from_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    directory = make_checkpoint(tmp_path, "runs/Qwen3-VL-2B-Thinking", processor=False)
    with pytest.raises(ConfigError) as info:
        resolve(directory)
    [problem] = info.value.problems
    assert problem.startswith(f"model.name: {directory} has no processor files (it lacks tokenizer.json")
    assert "preprocessor_config.json" in problem
    assert "'Qwen/Qwen3-VL-2B-Thinking' is not a local directory and not in the Hugging Face cache" in problem
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in problem

    published = make_checkpoint(tmp_path, "published/Qwen3-VL-2B-Thinking")
    snapshot = fake_hub_cache(cache, "Qwen/Qwen3-VL-2B-Thinking", published)
    rc = resolve(directory)
    assert rc.processor.kind == "family" and rc.processor.directory == snapshot
    assert (
        rc.config.model.processor == "Qwen/Qwen3-VL-2B-Thinking"
        and rc.from_family["model.processor"] == "family qwen3_vl"
    )
    assert processor_line(rc) == (
        "processor: Qwen/Qwen3-VL-2B-Thinking (from family qwen3_vl, its processor for checkpoint "
        f"'Qwen3-VL-2B-Thinking' (the checkpoint has no processor files), loaded from {snapshot})"
    )
    processor, prompt = render(rc)
    assert processor.chat_template == transformers_template(snapshot) == THINKING_TEMPLATE
    # a name without a folder part (a checkpoint in the current directory) names the checkpoint the same way
    monkeypatch.chdir(directory.parent)
    assert processor_line(resolve(directory.name)) == (
        "processor: Qwen/Qwen3-VL-2B-Thinking (from family qwen3_vl, its processor for checkpoint "
        f"'Qwen3-VL-2B-Thinking' (the checkpoint has no processor files), loaded from {snapshot})"
    )
    assert THINKING_MARK in prompt


def test_a_hub_id_resolves_through_the_cache_and_offline_says_so(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snapshot = fake_hub_cache(cache, "Qwen/Qwen3-VL-2B-Thinking", make_checkpoint(tmp_path, "src/Qwen3-VL-2B-Thinking"))
    rc = resolve("Qwen/Qwen3-VL-2B-Thinking")
    assert rc.checkpoint_dir == snapshot and find_checkpoint("Qwen/Qwen3-VL-2B-Thinking") == snapshot
    assert rc.processor.kind == "checkpoint" and rc.processor.directory == snapshot
    assert rc.config.rollout.thinking_mode == "on"
    assert load_processor(rc).chat_template == THINKING_TEMPLATE
    with pytest.raises(ConfigError) as info:
        resolve("Qwen/Qwen3-VL-2B-Instruct")
    assert info.value.problems == [
        (
            "model.name: 'Qwen/Qwen3-VL-2B-Instruct' is not a local directory and not in the Hugging Face cache "
            f"({cache}), and offline mode is on (HF_HUB_OFFLINE=1): download it where there is network "
            "(`hf download Qwen/Qwen3-VL-2B-Instruct`), or unset HF_HUB_OFFLINE. No model in the cache is close to it "
            "(1 cached); offline, vlmreg cannot ask the Hub whether it exists: check its spelling there"
        )
    ]


def test_offline_a_misspelt_hub_id_is_told_from_one_not_downloaded(tmp_path, monkeypatch):
    """Issue 31 item 8: both got the same message. A cached id close to the one asked for is named; an id no Hub
    repository can have is refused as such."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    fake_hub_cache(cache, "Qwen/Qwen3-VL-2B-Thinking", make_checkpoint(tmp_path, "src/Qwen3-VL-2B-Thinking"))
    with pytest.raises(ConfigError) as info:
        resolve("Qwen/Qwen3-VL-2B-Thinkng")
    [problem] = info.value.problems
    assert problem.endswith("or unset HF_HUB_OFFLINE. Did you mean 'Qwen/Qwen3-VL-2B-Thinking'? (in the cache)")
    with pytest.raises(ConfigError) as info:
        resolve("Qwen/Qwen3 VL")
    [problem] = info.value.problems
    assert problem.startswith("model.name: 'Qwen/Qwen3 VL' is not a local directory, nor a valid Hub id: ")


def test_online_a_hub_id_is_fetched_as_transformers_would(tmp_path, monkeypatch):
    """Without HF_HUB_OFFLINE, resolution asks the hub for the config, tokenizer and processor files (never weights),
    and nothing is forced local; the hub client is replaced here by one that 'downloads' from a local directory."""

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    published = make_checkpoint(tmp_path, "published/Qwen3-VL-2B-Instruct")
    calls = []

    def download(repo_id, *, allow_patterns, cache_dir, local_files_only):
        calls.append((repo_id, tuple(allow_patterns), cache_dir, local_files_only))
        return str(fake_hub_cache(Path(cache_dir), repo_id, published))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    rc = resolve("Qwen/Qwen3-VL-2B-Instruct")
    assert calls == [("Qwen/Qwen3-VL-2B-Instruct", METADATA_FILES, str(tmp_path / "hub"), False)]
    assert not any("safetensors" in pattern for pattern in METADATA_FILES)
    assert rc.processor.kind == "checkpoint" and rc.config.rollout.thinking_mode == "off"


def test_model_processor_may_be_a_processor_only_directory(tmp_path):
    checkpoint = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct", processor=False)
    processor_dir = tmp_path / "processor"
    processor_dir.mkdir()
    (processor_dir / "chat_template.json").write_text(json.dumps({"chat_template": THINKING_TEMPLATE}))
    tiny_processor_files(processor_dir)
    rc = resolve_config(parse_config({"model": {"name": str(checkpoint), "processor": str(processor_dir)}}))
    assert rc.processor.kind == "model.processor" and rc.processor.directory == processor_dir
    assert processor_line(rc) == f"processor: {processor_dir} (from the config (model.processor))"
    assert load_processor(rc).chat_template == THINKING_TEMPLATE
    (processor_dir / "preprocessor_config.json").unlink()
    with pytest.raises(ConfigError, match=f"model.processor: {processor_dir} lacks preprocessor_config.json"):
        resolve_config(parse_config({"model": {"name": str(checkpoint), "processor": str(processor_dir)}}))


def test_a_random_init_needs_no_files():
    rc = resolve_config(parse_config({"model": {"init": "random", "family": "qwen3_vl"}}))
    assert rc.processor.kind == "tiny" and rc.processor.directory is None and rc.config.model.processor is None


def test_an_instruct_template_in_tokenizer_config_only_is_used(tmp_path):
    """No processor-level template: the tokenizer's (tokenizer_config.json) is used, as AutoTokenizer loads it."""
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    (directory / "chat_template.json").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": INSTRUCT_TEMPLATE}))

    rc = resolve(directory)
    assert transformers_template(directory) is None  # transformers' processor would have none
    assert (
        load_processor(rc).chat_template == AutoTokenizer.from_pretrained(directory).chat_template == INSTRUCT_TEMPLATE
    )


def test_a_damaged_tokenizer_config_does_not_hide_the_processor_config_s_template(tmp_path):
    """The chat template may live in processor_config.json; an unreadable tokenizer_config.json before it is skipped,
    not the end of the search (transformers reads the processor's template from processor_config.json as well)."""
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    (directory / "chat_template.json").unlink()
    (directory / "tokenizer_config.json").write_text("{ not json")
    assert any("chat template" in m for m in missing_processor_files(directory, vision=True))
    config = json.loads((directory / "preprocessor_config.json").read_text())
    (directory / "processor_config.json").write_text(json.dumps({**config, "chat_template": INSTRUCT_TEMPLATE}))
    assert not any("chat template" in m for m in missing_processor_files(directory, vision=True))


def test_a_cached_hub_snapshot_without_config_json_names_the_id_and_the_snapshot(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    source = make_checkpoint(tmp_path, "src/Qwen3-VL-2B-Instruct")
    (source / "config.json").unlink()
    snapshot = fake_hub_cache(cache, "Qwen/Qwen3-VL-2B-Instruct", source)
    with pytest.raises(VlmregError) as info:
        find_checkpoint("Qwen/Qwen3-VL-2B-Instruct")
    assert (
        str(info.value)
        == f"'Qwen/Qwen3-VL-2B-Instruct' (cached at {snapshot}) has no config.json; is it a transformers checkpoint?"
    )


def test_a_checkpoint_of_a_model_type_no_family_claims_is_a_problem_of_model_name(tmp_path):
    directory = make_checkpoint(tmp_path, "runs/mystery")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "mystery_vl"}))
    with pytest.raises(ConfigError) as info:
        resolve(directory)
    [problem] = info.value.problems
    assert problem.startswith("model.name: ") and "'mystery_vl'" in problem


@pytest.mark.parametrize("where", ["chat_template.jinja", "additional_chat_templates/default.jinja"])
def test_a_chat_template_in_a_jinja_file_is_found_as_transformers_finds_it(tmp_path, where):
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    (directory / "chat_template.json").unlink()
    (directory / where).parent.mkdir(exist_ok=True)
    (directory / where).write_text(INSTRUCT_TEMPLATE)
    assert AutoTokenizer.from_pretrained(directory).chat_template  # the reference: transformers reads it
    rc = resolve(directory)
    assert rc.processor.kind == "checkpoint" and rc.processor.note == "the checkpoint directory"


def test_what_a_processor_directory_lacks_is_listed_whole(tmp_path):
    """Each part a directory lacks, in one line, ``; ``-separated, for ``model.processor`` and ``model.name``."""
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.json"):
        (directory / name).unlink()
    parts = (
        "tokenizer.json (or tokenizer_config.json with vocab.json + merges.txt, tokenizer.model or vocab.txt); "
        'a chat template (chat_template.json, chat_template.jinja, or "chat_template" in tokenizer_config.json)'
    )
    with pytest.raises(ConfigError) as info:
        resolve(directory)
    assert info.value.problems == [
        f"model.name: {directory} lacks {parts}. Add them (the base checkpoint has them), or set model.processor"
    ]
    document = {"model": {"init": "random", "family": "qwen3_vl", "processor": str(directory)}}
    with pytest.raises(ConfigError) as info:
        resolve_config(parse_config(document))
    assert info.value.problems == [f"model.processor: {directory} lacks {parts}"]


def test_a_model_only_save_whose_family_processor_lacks_files_names_both(tmp_path, monkeypatch):
    """The family's processor for a model-only save is checked as a checkpoint's own is (here its image processor
    config and chat template are missing from the cache); a checkpoint named with a trailing ``/`` is named by its
    whole folder name."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    directory = make_checkpoint(tmp_path, "runs/Qwen3-VL-2B-Thinking", processor=False)
    published = make_checkpoint(tmp_path, "published/Qwen3-VL-2B-Thinking")
    snapshot = fake_hub_cache(cache, "Qwen/Qwen3-VL-2B-Thinking", published)
    for name in ("preprocessor_config.json", "chat_template.json"):
        (snapshot / name).unlink()
    with pytest.raises(ConfigError) as info:
        resolve(directory)
    assert info.value.problems == [
        (
            f"model.name: {directory} has no processor files (it lacks tokenizer.json (or tokenizer_config.json "
            "with vocab.json + merges.txt, tokenizer.model or vocab.txt); preprocessor_config.json (or "
            'processor_config.json); a chat template (chat_template.json, chat_template.jinja, or "chat_template" in '
            "tokenizer_config.json)), and family qwen3_vl's processor for it, 'Qwen/Qwen3-VL-2B-Thinking', cannot "
            f"be used: 'Qwen/Qwen3-VL-2B-Thinking' (cached at {snapshot}) lacks preprocessor_config.json (or "
            'processor_config.json); a chat template (chat_template.json, chat_template.jinja, or "chat_template" in '
            "tokenizer_config.json). Set model.processor"
        )
    ]
    for name in ("preprocessor_config.json", "chat_template.json"):
        (snapshot / name).write_bytes((published / name).read_bytes())
    other = make_checkpoint(tmp_path, "runs/Qwen3-VL-2B-Thinking-X", processor=False)
    rc = resolve(f"{other}/")
    assert rc.processor.note == (
        "family qwen3_vl, its processor for checkpoint 'Qwen3-VL-2B-Thinking-X' (the checkpoint has no processor files)"
    )
