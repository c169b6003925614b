"""`vlmreg validate` and `vlmreg config --resolved` on real-looking checkpoint directories: the processor in use
and where it came from, the thinking mode, and missing files named."""

from __future__ import annotations

import tomllib

import pytest

from tests.config.checkpoints import fake_hub_cache, make_checkpoint
from vlmreg.cli import main


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def write(tmp_path, model: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(f"[model]\n{model}\n")
    return str(path)


def out(capsys, *argv) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_validate_names_the_processor_directory_and_the_thinking_mode(tmp_path, capsys):
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Thinking")
    config = write(tmp_path, f'name = "{directory}"')
    lines = [" ".join(line.split()) for line in out(capsys, "validate", config).splitlines()]
    assert lines[0].startswith(f"ok {config}: family qwen3_vl")
    assert lines[1] == f"processor: {directory} (from the checkpoint directory)"
    assert lines[2] == "thinking mode: on (the checkpoint's own chat template, no arguments)"


def test_config_resolved_shows_the_processor_and_its_source(tmp_path, capsys):
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    text = out(capsys, "config", write(tmp_path, f'name = "{directory}"'), "--resolved")
    assert f'processor = "{directory}"  # from the checkpoint directory' in text.splitlines()
    assert 'thinking_mode = "off"  # from family qwen3_vl' in text.splitlines()
    assert tomllib.loads(text)["model"]["processor"] == str(directory)

    random = out(capsys, "config", write(tmp_path, 'init = "random"\nfamily = "qwen3_5"'), "--resolved")
    assert "# processor = (unset)  # from family qwen3_5, its tiny processor (random init)" in random.splitlines()
    assert "# thinking mode: on (chat template gets enable_thinking=True)" in random.splitlines()


def test_config_resolved_shows_the_family_processor_of_a_model_only_save(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snapshot = fake_hub_cache(cache, "Qwen/Qwen3-VL-2B-Instruct", make_checkpoint(tmp_path, "hub/Qwen3-VL-2B-Instruct"))
    directory = make_checkpoint(tmp_path, "runs/Qwen3-VL-2B-Instruct", processor=False)
    text = out(capsys, "config", write(tmp_path, f'name = "{directory}"'), "--resolved")
    expected = (
        'processor = "Qwen/Qwen3-VL-2B-Instruct"  # from family qwen3_vl, '
        "its processor for checkpoint 'Qwen3-VL-2B-Instruct' (the checkpoint has no processor files)"
    )
    assert expected in text.splitlines()
    assert f"loaded from {snapshot})" in text.splitlines()[1]


def test_validate_names_missing_files_and_the_directory(tmp_path, capsys):
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    (directory / "preprocessor_config.json").unlink()
    (directory / "tokenizer.json").unlink()
    config = write(tmp_path, f'name = "{directory}"')
    assert main(["validate", config]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err
    assert (
        f"model.name: {directory} lacks tokenizer.json" in err
        and "; preprocessor_config.json (or processor_config.json)" in err
    )
