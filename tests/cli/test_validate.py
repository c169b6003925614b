"""`vlmreg validate`: every problem in one report, and with ``--data`` every record and image the run would read."""

from __future__ import annotations

import json
from pathlib import Path

from tests.data.samples import png_bytes
from vlmreg.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(["validate", *argv])
    captured = capsys.readouterr()
    squash = lambda text: [" ".join(line.split()) for line in text.splitlines()]  # noqa: E731
    return code, squash(captured.out), squash(captured.err)


def test_a_problem_judged_against_a_dropped_value_is_left_out(tmp_path, capsys):
    # init is misspelt: judged with the default init ("pretrained"), the config would also lack model.name; it does
    # not, and the unknown objective, a registry check that used to wait for the schema, is in the same report.
    config = tmp_path / "run.toml"
    config.write_text('[model]\ninit = "randm"\nfamily = "qwen3_vl"\n[trainer]\nalgorithm = "gpro"\n')
    code, _, err = run(capsys, str(config))
    assert code == 1 and err[0] == f"error: {config}: 2 problems", err
    assert any(line.startswith("model.init: must be one of 'pretrained', 'random' (got 'randm')") for line in err)
    assert any(line.startswith("trainer.algorithm: Unknown objective 'gpro'") for line in err)
    assert not any(line.startswith("model.name") for line in err), err


def test_a_broken_model_table_does_not_hide_the_other_tables_names(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('model = 3\n[data]\ntask = "color"\n')
    code, _, err = run(capsys, str(config))
    assert code == 1 and err[0] == f"error: {config}: 2 problems", err
    assert "model: expected a table (got 3, an integer)" in err
    assert any(line.startswith("data.task: Unknown task 'color'. Did you mean 'colour'?") for line in err)


def write_dataset(tmp_path) -> str:
    """A dataset of five records: good, a missing image file, not JSON, no answer, and two images of which one is
    not an image; and a config training on it."""
    (tmp_path / "red.png").write_bytes(png_bytes((16, 16)))
    (tmp_path / "broken.png").write_bytes(b"not a png at all")

    def record(*images: str, answer: str | None = "Red") -> str:
        content = [{"type": "image", "image": name} for name in images] + [{"type": "text", "text": "Which colour?"}]
        row = {"messages": [{"role": "user", "content": content}]}
        return json.dumps(row | ({"answer": answer} if answer is not None else {}))

    lines = [
        record("red.png"),
        record("missing.png"),
        '{"messages": [',
        record("red.png", answer=None),
        record("red.png", "broken.png"),
    ]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\ninit = "random"\nfamily = "qwen3_vl"\n[data]\npaths = ["train.jsonl"]\n[reward]\nfunctions = { '
        "exact_match = 1.0 }\n"
    )
    return str(config)


def test_validate_data_reports_every_bad_record_and_image_with_its_file_and_line(tmp_path, capsys, monkeypatch):
    config = write_dataset(tmp_path)
    code, out, _ = run(capsys, config)
    assert code == 0 and out[0].startswith(f"ok {config}"), "without --data the files are not read"

    monkeypatch.chdir(tmp_path.parent)  # relative data paths are read from the config's folder, as `train` reads them
    code, out, err = run(capsys, config, "--data")
    assert code == 1 and err[0] == f"error: {config}: 4 problems", err
    text = "\n".join(err)
    assert "train.jsonl:2 messages[0].content[0].image:" in text and "missing.png" in text
    assert "train.jsonl:3: not valid JSON" in text
    assert "train.jsonl:4: no answer" in text
    assert "train.jsonl:5 messages[0].content[1].image:" in text
    assert not any("train.jsonl:1" in line or "train.jsonl:5 messages[0].content[0]" in line for line in err), text
    assert "data (train): 4 records and 2 images read from 1 file: 1 example" in err


def test_validate_data_counts_what_it_read_when_all_is_well(tmp_path, capsys):
    config = write_dataset(tmp_path)
    (tmp_path / "train.jsonl").write_text("\n".join((tmp_path / "train.jsonl").read_text().splitlines()[:1] * 3) + "\n")
    code, out, err = run(capsys, config, "--data")
    assert code == 0, err
    assert out[0].startswith(f"ok {config}")
    assert out[-1] == "data (train): 3 records and 3 images read from 1 file: 3 examples"


def test_validate_data_with_a_task_reads_no_files(capsys):
    code, out, _ = run(capsys, str(ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml"), "--data")
    assert code == 0
    assert out[-1] == "data (train): task colour generates its examples; no files to read"


def test_validate_data_with_skip_lists_the_records_the_run_would_skip(tmp_path, capsys):
    config = write_dataset(tmp_path)
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join([lines[0], lines[1]]) + "\n")  # a good record, a missing image
    (tmp_path / "run.toml").write_text(
        (tmp_path / "run.toml").read_text().replace("[data]\n", '[data]\non_bad_image = "skip"\n')
    )
    code, out, err = run(capsys, config, "--data")
    assert code == 0, err
    assert any(
        line.startswith("warning train.jsonl:2 messages[0].content[0].image:") and "missing.png" in line for line in err
    ), err
    assert (
        out[-1]
        == 'data (train): 2 records and 1 image read from 1 file: 1 example, 1 record skipped (on_bad_image = "skip")'
    )
