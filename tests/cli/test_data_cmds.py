"""`vlmreg data preview` on bundled tasks, JSONL and Parquet files (text, JSON, contact sheet); `vlmreg data tasks`."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import vlmreg
from tests.data.samples import data_uri, png_bytes
from vlmreg.cli import main

RED = png_bytes((64, 64), (255, 0, 0))
WIDE_BLUE = png_bytes((128, 64), (0, 0, 255))  # 8 x 4 patches of 16 px, merged 2 x 2: 8 image tokens


def write_config(folder: Path, data: str, reward: bool = True) -> str:
    """A tiny random qwen3_vl run config in ``folder`` with the given ``[data]`` body."""
    body = f'[model]\ninit = "random"\nfamily = "qwen3_vl"\n\n[data]\n{data}\n'
    if reward:
        body += "\n[reward]\nfunctions = { exact_match = 1.0 }\n"
    path = folder / "run.toml"
    path.write_text(body)
    return str(path)


def preview_json(capsys, *argv: str) -> dict[str, Any]:
    assert main(["data", "preview", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def error_lines(capsys, *argv: str) -> list[str]:
    assert main(list(argv)) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    return captured.err.strip().splitlines()


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


@pytest.fixture
def jsonl_config(tmp_path: Path) -> str:
    """Three records: a data-URI image, a relative path used twice next to text, and text only."""
    (tmp_path / "data" / "images").mkdir(parents=True)
    (tmp_path / "data" / "images" / "wide.png").write_bytes(WIDE_BLUE)
    records = [
        {
            "messages": [
                user(
                    {"type": "image_url", "image_url": {"url": data_uri(RED)}}, {"type": "text", "text": "What colour?"}
                )
            ],
            "answer": "red",
        },
        {
            "messages": [
                user(
                    {"type": "text", "text": "Compare"},
                    {"type": "image_url", "image_url": "images/wide.png"},
                    {"type": "text", "text": "with"},
                    {"type": "image", "image": "images/wide.png"},
                )
            ],
            "answer": "same",
        },
        {"messages": [{"role": "user", "content": "No image here."}], "answer": "none"},
    ]
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return write_config(tmp_path, 'paths = ["data/train.jsonl"]\nsystem_prompt = "Be brief."')


def test_preview_colour_task_shows_image_sizes_tokens_and_totals(tmp_path, capsys):
    config = write_config(tmp_path, 'task = "colour"\nnum_samples = 6', reward=False)
    record = preview_json(capsys, config)
    assert (record["family"], record["examples"], record["skipped"]) == ("qwen3_vl", 6, 0)
    assert record["unique_images"] == 6 and record["image_tokens"] == 6 * 4
    assert record["source"] == "task colour: 6 generated examples (seed 0)"
    assert [s["id"] for s in record["samples"]] == ["colour:0", "colour:1", "colour:2", "colour:3"]  # --n defaults to 4
    for sample in record["samples"]:
        (message,) = sample["messages"]
        assert message["role"] == "user"
        assert message["text"] == "[image 64x64, 4 tokens] What colour is the shape? Red, Green or Blue?"
        (image,) = message["images"]
        assert (image["width"], image["height"], image["tokens"]) == (64, 64, 4) and len(image["id"]) == 24
        assert (
            sample["answer"] in {"Red", "Green", "Blue"} and sample["image_tokens"] == 4 and sample["task"] == "colour"
        )


def test_preview_count_task_as_text(tmp_path, capsys):
    config = write_config(tmp_path, 'task = "count"\nnum_samples = 5', reward=False)
    assert main(["data", "preview", config, "--n", "2"]) == 0
    out = capsys.readouterr().out
    assert "count:0" in out and "count:1" in out and "count:2" not in out
    assert out.count("[image 128x128, 16 tokens] How many shapes are there? Put the number in \\boxed{}.") == 2
    assert "5 examples, 0 skipped records, 5 unique images, 80 image tokens (qwen3_vl processor)" in out


def test_preview_jsonl_messages_counts_each_image_once_and_adds_the_system_prompt(jsonl_config, capsys):
    record = preview_json(capsys, jsonl_config, "--n", "3")
    assert (record["examples"], record["unique_images"], record["image_tokens"]) == (3, 2, 4 + 8 + 8)
    first, second, third = record["samples"]
    assert [m["role"] for m in first["messages"]] == ["system", "user"] and first["messages"][0]["text"] == "Be brief."
    assert first["messages"][1]["text"] == "[image 64x64, 4 tokens] What colour?" and first["answer"] == "red"
    assert second["id"] == "data/train.jsonl:2"
    assert second["messages"][1]["text"] == "Compare [image 128x64, 8 tokens] with [image 128x64, 8 tokens]"
    assert second["image_tokens"] == 16 and len({i["id"] for i in second["messages"][1]["images"]}) == 1
    assert (
        third["messages"][1] == {"role": "user", "text": "No image here.", "images": []} and third["image_tokens"] == 0
    )


def test_preview_parquet_placeholder_layout_counts_skipped_records(tmp_path, capsys):
    rows = [
        {"images": [{"bytes": RED, "path": None}], "problem": "<image>Find x.", "answer": "3"},
        {"images": [{"bytes": b"not an image", "path": None}], "problem": "<image>Broken.", "answer": "4"},
        {
            "images": [{"bytes": WIDE_BLUE, "path": None}, {"bytes": RED, "path": None}],
            "problem": "Is <image> wider than <image>?",
            "answer": "yes",
        },
    ]
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("images", pa.list_(image)), ("problem", pa.string()), ("answer", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / "geo.parquet")
    config = write_config(
        tmp_path, 'format = "placeholder"\npaths = ["geo.parquet"]\nprompt_key = "problem"\non_bad_image = "skip"'
    )
    record = preview_json(capsys, config)
    assert (record["examples"], record["skipped"], record["unique_images"], record["image_tokens"]) == (
        2,
        1,
        2,
        4 + 8 + 4,
    )
    assert [s["id"] for s in record["samples"]] == ["geo.parquet:0", "geo.parquet:2"]
    assert record["samples"][0]["messages"][0]["text"] == "[image 64x64, 4 tokens] Find x."
    assert (
        record["samples"][1]["messages"][0]["text"] == "Is [image 128x64, 8 tokens] wider than [image 64x64, 4 tokens]?"
    )
    assert main(["data", "preview", config]) == 0
    assert "2 examples, 1 skipped records, 2 unique images, 16 image tokens" in capsys.readouterr().out


def test_contact_sheet_is_a_png_with_the_images_that_grows_with_n(jsonl_config, tmp_path, capsys):
    sizes = {}
    for n in (1, 3):
        out = tmp_path / f"sheet{n}.png"
        record = preview_json(capsys, jsonl_config, "--n", str(n), "--out", str(out))
        assert record["contact_sheet"] == str(out)
        with Image.open(out) as sheet:
            assert sheet.format == "PNG"
            sizes[n] = sheet.size
            colours = {colour for _, colour in sheet.convert("RGB").getcolors(1 << 20)}
        assert (255, 0, 0) in colours  # sample 1's red image, as a thumbnail
        assert ((0, 0, 255) in colours) == (n == 3)  # sample 2's blue image only when it is shown
    assert sizes[3][0] > sizes[1][0] and sizes[3][1] >= sizes[1][1]
    assert main(["data", "preview", jsonl_config, "--n", "1", "--out", str(tmp_path / "sheet.png")]) == 0
    assert f"contact sheet: {tmp_path / 'sheet.png'}" in capsys.readouterr().out


def test_data_tasks_lists_the_bundled_tasks_with_their_distribution(capsys):
    assert main(["data", "tasks", "--json"]) == 0
    records = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {"colour", "count"} <= set(records)
    colour, count = records["colour"], records["count"]
    assert colour["plugin"] == count["plugin"] == "vlmreg"
    assert colour["reward"] == {"first_word": 1.0} and colour["choices"] == ["Red", "Green", "Blue"]
    assert count["reward"] == {"math": 1.0} and count["choices"] == [f"\\boxed{{{i}}}" for i in range(1, 7)]
    assert colour["description"].startswith("A 64x64 image") and colour["multi_turn"] is False
    assert main(["data", "tasks"]) == 0
    out = capsys.readouterr().out
    assert "colour  from vlmreg" in out and "first_word 1" in out and '[data] task = "NAME"' in out


def test_unknown_task_is_an_error_without_traceback(tmp_path, capsys):
    config = write_config(tmp_path, 'task = "colr"', reward=False)
    lines = error_lines(capsys, "data", "preview", config)
    # a config error: a header line, then one line per problem (as `vlmreg validate` prints it)
    assert lines[0] == f"error: {config}: 1 problem"
    assert lines[1].strip().startswith("data.task: Unknown task 'colr'. Did you mean 'colour'?")


def test_bad_data_file_and_bad_out_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text(
        json.dumps({"messages": [user({"type": "text", "text": "Hi"})], "answer": "a"}) + "\n{oops\n"
    )
    config = write_config(tmp_path, 'paths = ["train.jsonl"]')
    assert error_lines(capsys, "data", "preview", config) == [
        "error: train.jsonl:2: not valid JSON (Expecting property name enclosed in double quotes at column 2)"
    ]
    lines = error_lines(capsys, "data", "preview", config, "--out", str(tmp_path / "sheet.jpg"))
    assert len(lines) == 1 and lines[0].endswith("the contact sheet is a PNG; name the file *.png")
    missing = write_config(tmp_path, 'paths = ["missing.jsonl"]')
    lines = error_lines(capsys, "data", "preview", missing)
    assert len(lines) == 1 and lines[0].startswith("error: data file not found: missing.jsonl")


def test_the_preview_in_docs_data_md_is_what_the_command_prints(capsys, monkeypatch):
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "data.md").read_text()
    section = doc[doc.index("## Previewing data") : doc.index("## From Python")]
    (command,) = re.findall(r"```bash\n(.*?)\n```", section, re.DOTALL)
    (printed,) = re.findall(r"```text\n(.*?)\n```", section, re.DOTALL)
    monkeypatch.chdir(root)
    assert main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out.rstrip("\n") == printed
    assert "a 300x200 image is 54 tokens" in section
    processor = vlmreg.get_family("qwen3_vl").tiny_processor()
    out = processor(text=[processor.image_token], images=[Image.new("RGB", (300, 200))], return_tensors="pt")
    assert int((out["input_ids"] == processor.tokenizer.convert_tokens_to_ids(processor.image_token)).sum()) == 54
