"""`vlmreg check DIR` on checkpoint directories with parts missing: it says which files it looked for, resolves
on the meta device (config.json is all that needs), and runs the prompt check only with a whole processor.

The directories are laid out as real Qwen3-VL checkpoints are (`tests.config.checkpoints`), from the tiny config.
"""

from __future__ import annotations

import json

from tests.config.checkpoints import make_checkpoint
from vlmreg.cli import main
from vlmreg.sdk.registry import get_registry


def check(capsys, directory, *extra):
    code = main(["check", str(directory), "--json", *extra])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, json.loads(captured.out) if captured.out.strip() else None, captured.err


def test_no_tokenizer_files_names_them_and_still_resolves(capsys, tmp_path):
    # config.json and preprocessor_config.json, no tokenizer files: once "turn_end_tokens entry '<|im_end|>' is 0
    # tokens"
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).unlink()
    code, summary, err = check(capsys, directory)
    assert code == 0, err
    assert summary["ok"] and summary["family"] == "qwen3_vl" and summary["num_layers"] == 2
    assert summary["parity"] == []
    [note] = summary["notes"]
    assert note.startswith(f"{directory} lacks tokenizer.json (or tokenizer_config.json with vocab.json + merges.txt")
    assert "preprocessor_config.json" not in note and "chat template" not in note  # it has those
    assert "so the prompt check against its processor did not run" in note and "model.processor" in note


def test_no_tokenizer_and_no_chat_template_name_both(capsys, tmp_path):
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.json"):
        (directory / name).unlink()
    assert main(["check", str(directory)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"ok family qwen3_vl resolves on {directory}" in out
    assert (
        "note" in out and "tokenizer.json" in out and "a chat template (chat_template.json, chat_template.jinja" in out
    )
    assert "turn_end_tokens" not in out


def test_a_config_alone_resolves_with_a_note(capsys, tmp_path):
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct", processor=False)
    for target in (directory, directory / "config.json"):
        code, summary, err = check(capsys, target)
        assert code == 0, err
        assert summary["ok"] and summary["family"] == "qwen3_vl" and summary["parity"] == []
        [note] = summary["notes"]
        assert (
            "tokenizer.json" in note
            and "preprocessor_config.json (or processor_config.json)" in note
            and "a chat template" in note
        )
        expected = get_registry().get("qwen3_vl").processor_id_for(str(directory))
        assert f"no processor files at all: training from it takes family qwen3_vl's processor {expected!r}" in note


def test_a_whole_processor_runs_the_prompt_check_with_it(capsys, tmp_path):
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    code, summary, err = check(capsys, directory)
    assert code == 0, err
    assert [r["name"] for r in summary["parity"]] == ["prompt, 1 image(s)", "prompt, 2 image(s)", "prompt, 3 image(s)"]
    assert all(r["ok"] for r in summary["parity"]) and summary["notes"] == []


def test_a_processor_that_does_not_fit_the_family_fails_the_prompt_check_after_resolving(capsys, tmp_path):
    # gemma3's tokenizer has no <|im_end|>, qwen3_vl's turn end: a failed check, not an error that hides the resolution
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct", processor=False)
    get_registry().get("gemma3").tiny_processor().save_pretrained(directory)
    code, summary, err = check(capsys, directory)
    assert code == 1 and not summary["ok"] and summary["num_layers"] == 2
    [result] = summary["parity"]
    assert result["name"] == "prompt, the checkpoint's processor" and not result["ok"]
    assert str(directory) in result["detail"] and "turn_end_tokens entry '<|im_end|>'" in result["detail"]
