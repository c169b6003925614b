"""load_examples on real JSONL and Parquet files: both layouts, every image source, skip mode, and every bad record."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.data.samples import data_uri, png_bytes
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.config.schema import DataSection
from vlmreg.data import DataError, ImageError, ImageStore, LoadedData, SkippedRecord, image_id_of, load_examples
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.example import image_part, text_part
from vlmreg.train.source import load_run_data

RED, GREEN, BLUE, GREY = (png_bytes((8, 8), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255), (128, 128, 128)))


def write_jsonl(path: Path, records: list[Any]) -> None:
    """One JSON value a line; a str record is written as the raw line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def load(base: Path, paths: list[str], **fields: Any) -> tuple[LoadedData, ImageStore]:
    store = ImageStore()
    return load_examples(DataSection(paths=paths, **fields), store, base_dir=base), store


def colour(store: ImageStore, image_id: str) -> tuple[int, int, int]:
    return store.get(image_id).getpixel((0, 0))


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def load_error(kind: type[Exception], base: Path, paths: list[str], **fields: Any) -> str:
    with pytest.raises(kind) as info:
        load(base, paths, **fields)
    message = str(info.value)
    assert isinstance(info.value, VlmregError) and "\n" not in message
    return message


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """``tmp/data/images/green.png``: image paths in records are relative to the data file's folder."""
    (tmp_path / "data" / "images").mkdir(parents=True)
    (tmp_path / "data" / "images" / "green.png").write_bytes(GREEN)
    return tmp_path


# -- the messages layout ------------------------------------------------------------------------------------
def test_messages_with_data_uris_relative_paths_and_a_repeated_image(data_dir):
    write_jsonl(
        data_dir / "data" / "train.jsonl",
        [
            {
                "messages": [
                    user(
                        {"type": "image_url", "image_url": {"url": data_uri(RED)}}, {"type": "text", "text": "Colour?"}
                    )
                ],
                "answer": "red",
                "source": "synthetic",
            },
            {
                "messages": [
                    user(
                        {"type": "text", "text": "And?"},
                        {"type": "image_url", "image_url": "images/green.png"},
                        {"type": "image", "image": "images/green.png"},
                    )
                ],
                "answer": "green",
            },
            {"messages": [{"role": "user", "content": "No image."}], "answer": "none"},
        ],
    )
    loaded, store = load(data_dir, ["data/train.jsonl"])
    assert loaded.skipped == [] and [e.id for e in loaded.examples] == [
        "data/train.jsonl:1",
        "data/train.jsonl:2",
        "data/train.jsonl:3",
    ]
    first, second, third = loaded.examples
    red_id = first.image_ids()[0]
    assert list(first.messages) == [user(image_part(red_id), text_part("Colour?"))]
    assert first.answer == "red" and first.metadata == {"source": "synthetic"} and first.task is None
    green_id = second.image_ids()[0]
    assert list(second.messages) == [user(text_part("And?"), image_part(green_id), image_part(green_id))]
    assert colour(store, red_id) == (255, 0, 0) and colour(store, green_id) == (0, 255, 0)
    assert list(third.messages) == [{"role": "user", "content": "No image."}] and third.image_ids() == []
    assert len(store) == 2  # the green image, referenced twice, is stored once


def test_prompt_alias_and_reward_spec_ground_truth(tmp_path):
    write_jsonl(
        tmp_path / "skyrl.jsonl",
        [
            {
                "prompt": [
                    user({"type": "image", "image": data_uri(BLUE)}, {"type": "text", "text": "What is shown?"})
                ],
                "reward_spec": {"method": "rule", "ground_truth": "a square"},
                "env_class": "vision",
            }
        ],
    )
    (example,) = load(tmp_path, ["skyrl.jsonl"])[0].examples
    assert example.answer == "a square" and example.id == "skyrl.jsonl:1"
    assert example.messages[0]["content"][1] == text_part("What is shown?")
    assert example.metadata == {"reward_spec": {"method": "rule", "ground_truth": "a square"}, "env_class": "vision"}


def test_system_prompt_num_samples_and_blank_lines(tmp_path):
    record = {"messages": [{"role": "user", "content": "Hi"}], "answer": "x"}
    write_jsonl(tmp_path / "a.jsonl", [record, "", "   ", record, record])
    loaded, _ = load(tmp_path, ["a.jsonl"], system_prompt="Answer briefly.", num_samples=2)
    assert [e.id for e in loaded.examples] == ["a.jsonl:1", "a.jsonl:4"]
    assert list(loaded.examples[0].messages) == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
    ]
    write_jsonl(
        tmp_path / "b.jsonl",
        [{"messages": [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}], "answer": "x"}],
    )
    assert load_error(DataError, tmp_path, ["b.jsonl"], system_prompt="Answer briefly.") == (
        "b.jsonl:1 messages[0]: the record has its own system message and [data] system_prompt is set; keep one"
    )


def test_several_files_in_order_with_an_absolute_path(tmp_path):
    record = {"messages": [{"role": "user", "content": "Hi"}], "answer": "x"}
    write_jsonl(tmp_path / "a.jsonl", [record])
    write_jsonl(tmp_path / "elsewhere" / "b.jsonl", [record, record])
    absolute = str(tmp_path / "elsewhere" / "b.jsonl")
    loaded, _ = load(tmp_path, ["a.jsonl", absolute])
    assert [e.id for e in loaded.examples] == ["a.jsonl:1", f"{absolute}:1", f"{absolute}:2"]


MALFORMED = [
    ("[1, 2]", "data.jsonl:1: record is an array, expected an object"),
    ('{"messages":', "data.jsonl:1: not valid JSON (Expecting value at column 13)"),
    ({"answer": "a"}, "data.jsonl:1: no 'messages' (or 'prompt') key (keys: answer)"),
    (
        {"messages": [{"role": "user", "content": "q"}]},
        "data.jsonl:1: no answer: expected key 'answer' or 'reward_spec.ground_truth' (keys: messages)",
    ),
    (
        {"messages": [], "answer": "a"},
        "data.jsonl:1 messages: expected a non-empty array of chat messages, got an empty array",
    ),
    (
        {"messages": [{"content": "q"}], "answer": "a"},
        "data.jsonl:1 messages[0].role: expected a role string, got null",
    ),
    (
        {"messages": [{"role": "user", "content": 3}], "answer": "a"},
        "data.jsonl:1 messages[0].content: expected a string or an array of parts, got a number",
    ),
    (
        {"messages": [user({"type": "text", "text": "q"}, {"type": "audio", "audio": "v.wav"})], "answer": "a"},
        (
            "data.jsonl:1 messages[0].content[1].type: unknown content part type 'audio'; expected 'text', "
            "'image_url', 'image', 'video' or 'video_url'"
        ),
    ),
    (
        {"messages": [user({"type": "image_url", "image_url": {"link": "x.png"}})], "answer": "a"},
        'data.jsonl:1 messages[0].content[0].image_url: expected a URL string or {"url": ...}, got an object',
    ),
    (
        {"messages": [user({"type": "image"})], "answer": "a"},
        (
            "data.jsonl:1 messages[0].content[0].image: expected an image (bytes, base64, data: URI, path or URL), "
            "got null"
        ),
    ),
    (
        {"messages": [user({"type": "text", "text": None})], "answer": "a"},
        "data.jsonl:1 messages[0].content[0].text: expected a string, got null",
    ),
    (
        {"messages": [], "prompt": [], "answer": "a"},
        "data.jsonl:1: has both 'messages' and 'prompt' (its alias); keep one",
    ),
]


@pytest.mark.parametrize(("record", "expected"), MALFORMED, ids=[m[1].split(": ", 1)[1][:40] for m in MALFORMED])
def test_malformed_records_are_errors_naming_record_and_key(tmp_path, record, expected):
    good = {"messages": [{"role": "user", "content": "fine"}], "answer": "x"}
    write_jsonl(tmp_path / "data.jsonl", [record, good])
    # A malformed record is an error in skip mode too: skip is for bad images only.
    assert load_error(DataError, tmp_path, ["data.jsonl"], on_bad_image="skip") == expected


def test_a_bad_image_is_an_error_naming_record_and_field(data_dir):
    write_jsonl(
        data_dir / "data" / "train.jsonl",
        [
            {"messages": [user({"type": "image_url", "image_url": {"url": "images/green.png"}})], "answer": "g"},
            {
                "messages": [
                    user(
                        {"type": "text", "text": "q"}, {"type": "image_url", "image_url": {"url": "images/missing.png"}}
                    )
                ],
                "answer": "m",
            },
        ],
    )
    assert load_error(ImageError, data_dir, ["data/train.jsonl"]) == (
        "data/train.jsonl:2 messages[0].content[1].image_url: image file not found: "
        f"{data_dir / 'data' / 'images' / 'missing.png'}"
    )


def test_a_url_while_fetching_is_off_names_the_record_and_how_to_enable_it(tmp_path):
    write_jsonl(
        tmp_path / "a.jsonl",
        [{"prompt": [user({"type": "image_url", "image_url": "https://example.com/x.png"})], "answer": "a"}],
    )
    assert load_error(ImageError, tmp_path, ["a.jsonl"]) == (
        "a.jsonl:1 prompt[0].content[0].image_url: fetching images over HTTP is off (https://example.com/x.png); "
        "set allow_http = true in [data] to allow it"
    )


def test_skip_mode_drops_and_counts_records_with_bad_images_and_stores_none_of_their_images(data_dir):
    corrupt = "data:image/png;base64,iVBORw0KGgo!!!"
    write_jsonl(
        data_dir / "data" / "train.jsonl",
        [
            {"messages": [user({"type": "image_url", "image_url": "images/green.png"})], "answer": "ok"},
            {"messages": [user({"type": "image_url", "image_url": corrupt})], "answer": "bad"},
            {
                "messages": [
                    user({"type": "image", "image": data_uri(GREY)}, {"type": "image", "image": data_uri(b"not a png")})
                ],
                "answer": "half",
            },
            {"messages": [user({"type": "image", "image": data_uri(RED)})], "answer": "ok"},
        ],
    )
    loaded, store = load(data_dir, ["data/train.jsonl"], on_bad_image="skip")
    assert [e.id for e in loaded.examples] == ["data/train.jsonl:1", "data/train.jsonl:4"]
    assert loaded.skipped == [
        SkippedRecord(
            "data/train.jsonl:2", "messages[0].content[0].image_url: not valid base64 (Only base64 data is allowed)"
        ),
        SkippedRecord(
            "data/train.jsonl:3",
            "messages[0].content[1].image: not an image (or not one of PNG, JPEG, GIF, WEBP, BMP, TIFF)",
        ),
    ]
    grey = image_id_of(Image.open(io.BytesIO(GREY)).convert("RGB"))
    assert len(store) == 2 and grey not in store  # record 3's good image was decoded, never stored


def test_every_record_skipped_is_an_error(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"messages": [user({"type": "image", "image": "gone.png"})], "answer": "a"}])
    assert load_error(DataError, tmp_path, ["a.jsonl"], on_bad_image="skip") == (
        f"every record was skipped for a bad image (1); the first: a.jsonl:1 messages[0].content[0].image: "
        f"image file not found: {tmp_path / 'gone.png'}"
    )


# -- the placeholder (geo3k) layout, on Parquet as Hugging Face datasets writes it --------------------------------
GEO3K = pa.schema(
    [
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ("problem", pa.string()),
        ("answer", pa.string()),
        ("uid", pa.int64()),
    ]
)


def write_geo3k(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=GEO3K), path)


def test_geo3k_placeholder_layout_on_parquet(tmp_path):
    (tmp_path / "geo" / "pics").mkdir(parents=True)
    (tmp_path / "geo" / "pics" / "green.png").write_bytes(GREEN)
    write_geo3k(
        tmp_path / "geo" / "train.parquet",
        [
            {"images": [{"bytes": RED, "path": "red.png"}], "problem": "<image>Find x.", "answer": "3", "uid": 0},
            {
                "images": [{"bytes": None, "path": "pics/green.png"}, {"bytes": BLUE, "path": None}],
                "problem": "Compare <image> with <image>.",
                "answer": "B",
                "uid": 1,
            },
            {"images": [{"bytes": RED, "path": None}], "problem": "No placeholder here.", "answer": "7", "uid": 2},
            {"images": [], "problem": "Text only.", "answer": "t", "uid": 3},
        ],
    )
    loaded, store = load(tmp_path, ["geo/train.parquet"], format="placeholder", prompt_key="problem")
    assert [e.id for e in loaded.examples] == [f"geo/train.parquet:{n}" for n in range(4)]
    (red,) = loaded.examples[0].image_ids()
    green, blue = loaded.examples[1].image_ids()
    assert list(loaded.examples[0].messages) == [user(image_part(red), text_part("Find x."))]
    assert list(loaded.examples[1].messages) == [
        user(text_part("Compare "), image_part(green), text_part(" with "), image_part(blue), text_part(".")),
    ]
    assert list(loaded.examples[2].messages) == [user(image_part(red), text_part("No placeholder here."))]
    assert list(loaded.examples[3].messages) == [{"role": "user", "content": "Text only."}]
    assert [e.answer for e in loaded.examples] == ["3", "B", "7", "t"] and loaded.examples[1].metadata == {"uid": 1}
    assert [colour(store, i) for i in (red, green, blue)] == [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    assert len(store) == 3  # red appears in two rows, stored once


def test_placeholder_count_mismatch_names_the_record(tmp_path):
    write_geo3k(
        tmp_path / "geo.parquet",
        [
            {"images": [{"bytes": RED, "path": None}], "problem": "<image>", "answer": "a", "uid": 0},
            {"images": [{"bytes": RED, "path": None}], "problem": "<image> and <image>", "answer": "a", "uid": 1},
        ],
    )
    assert load_error(DataError, tmp_path, ["geo.parquet"], format="placeholder", prompt_key="problem") == (
        "geo.parquet:1 problem: 2 <image> placeholders but 1 image in images"
    )


def test_placeholder_bad_image_in_skip_and_error_modes(tmp_path):
    write_geo3k(
        tmp_path / "geo.parquet",
        [
            {"images": [{"bytes": b"\x89PNG broken", "path": None}], "problem": "<image>", "answer": "a", "uid": 0},
            {"images": [{"bytes": RED, "path": None}], "problem": "<image>", "answer": "b", "uid": 1},
        ],
    )
    fields = {"format": "placeholder", "prompt_key": "problem"}
    loaded, _ = load(tmp_path, ["geo.parquet"], on_bad_image="skip", **fields)
    assert [e.id for e in loaded.examples] == ["geo.parquet:1"]
    assert [s.record for s in loaded.skipped] == ["geo.parquet:0"] and loaded.skipped[0].reason.startswith(
        "images[0]: not an image"
    )
    assert load_error(ImageError, tmp_path, ["geo.parquet"], **fields).startswith(
        "geo.parquet:0 images[0]: not an image"
    )


def test_placeholder_jsonl_with_base64_cells_several_columns_chat_prompt_and_dotted_answer(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "blue.png").write_bytes(BLUE)
    write_jsonl(
        tmp_path / "d" / "verl.jsonl",
        [
            {
                "prompt": [{"role": "user", "content": "<image> then <image> then <image>?"}],
                "images": [base64.b64encode(RED).decode(), "blue.png"],
                "diagram": {"bytes": None, "path": "blue.png"},
                "reward_model": {"style": "rule", "ground_truth": "42"},
            }
        ],
    )
    loaded, store = load(
        tmp_path,
        ["d/verl.jsonl"],
        format="placeholder",
        image_keys=["images", "diagram"],
        answer_key="reward_model.ground_truth",
        system_prompt="Think.",
    )
    (example,) = loaded.examples
    red, blue, blue_again = example.image_ids()
    assert blue == blue_again and len(store) == 2 and colour(store, red) == (255, 0, 0)
    assert list(example.messages) == [
        {"role": "system", "content": "Think."},
        user(
            image_part(red),
            text_part(" then "),
            image_part(blue),
            text_part(" then "),
            image_part(blue),
            text_part("?"),
        ),
    ]
    assert example.answer == "42" and example.metadata == {"reward_model": {"style": "rule", "ground_truth": "42"}}


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"images": [], "answer": "a"}, "p.jsonl:1: no prompt column 'prompt' (columns: images, answer)"),
        ({"prompt": "<image>", "answer": "a"}, "p.jsonl:1: no image column 'images' (columns: prompt, answer)"),
        (
            {"prompt": "<image>", "images": [{"path": None}], "answer": "a"},
            "p.jsonl:1 images[0]: image object has neither 'bytes' nor 'path'",
        ),
        (
            {"prompt": "<image>", "images": [7], "answer": "a"},
            "p.jsonl:1 images[0]: expected an image (bytes, base64, data: URI, path or URL), got a number",
        ),
        (
            {"prompt": "q", "images": [], "answer": None},
            "p.jsonl:1: no answer: expected key 'answer' (keys: prompt, images, answer)",
        ),
        (
            {"prompt": [{"role": "user", "content": [{"type": "text", "text": "q"}]}], "images": [], "answer": "a"},
            "p.jsonl:1 prompt[0].content: expected a string with <image> placeholders, got an array",
        ),
    ],
)
def test_malformed_placeholder_records(tmp_path, record, expected):
    write_jsonl(tmp_path / "p.jsonl", [record])
    assert load_error(DataError, tmp_path, ["p.jsonl"], format="placeholder") == expected


# -- files ----------------------------------------------------------------------------------------------------
def test_file_errors_name_the_path(tmp_path):
    assert load_error(DataError, tmp_path, ["data/nope.jsonl"]) == (
        f"data file not found: data/nope.jsonl (looked for {tmp_path / 'data' / 'nope.jsonl'})"
    )
    (tmp_path / "train.csv").write_text("a,b\n")
    assert (
        load_error(DataError, tmp_path, ["train.csv"])
        == "train.csv: unknown data file type '.csv'; expected .jsonl or .parquet"
    )
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    assert load_error(DataError, tmp_path, ["broken.parquet"]).startswith(
        "broken.parquet: not a readable Parquet file ("
    )
    (tmp_path / "empty.jsonl").write_text("\n")
    assert load_error(DataError, tmp_path, ["empty.jsonl"]) == "no records in empty.jsonl"
    (tmp_path / "latin1.jsonl").write_bytes(b'{"a": "caf\xe9"}\n')
    assert (
        load_error(DataError, tmp_path, ["latin1.jsonl"])
        == "latin1.jsonl:1: not UTF-8 text (invalid continuation byte at byte 11 of the line)"
    )


def test_paths_default_to_the_working_directory(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "Hi"}], "answer": "x"}])
    monkeypatch.chdir(tmp_path)
    assert [e.id for e in load_examples(DataSection(paths=["a.jsonl"]), ImageStore()).examples] == ["a.jsonl:1"]
    with pytest.raises(DataError, match=r"^\[data\] paths is empty"):
        load_examples(DataSection(task="colour"), ImageStore())


# -- docs/data.md ------------------------------------------------------------------------------------------------
def test_the_records_in_docs_data_md_load(tmp_path):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    # the video one: tests/data/test_video.py
    messages_record, placeholder_record, _video_record = (
        json.loads(b) for b in re.findall(r"```jsonl\n(.*?)\n```", doc, re.S)
    )
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "cat.png").write_bytes(GREY)
    (tmp_path / "images" / "triangle.png").write_bytes(BLUE)
    write_jsonl(tmp_path / "messages.jsonl", [messages_record])
    write_jsonl(tmp_path / "placeholder.jsonl", [placeholder_record])
    (cat,) = load(tmp_path, ["messages.jsonl"])[0].examples
    assert cat.answer == "cat" and cat.messages[0]["content"][1] == text_part("What animal is this?")
    (geo,) = load(tmp_path, ["placeholder.jsonl"], format="placeholder", prompt_key="problem")[0].examples
    assert list(geo.messages) == [user(image_part(geo.image_ids()[0]), text_part("In the triangle, find x."))]
    assert geo.answer == "12"


def test_the_held_out_files_are_cut_by_eval_num_samples_not_data_num_samples(tmp_path):
    """[eval] num_samples is the held-out split's size whether the task generates it or files hold it."""

    record = {"messages": [{"role": "user", "content": "Hi"}], "answer": "x"}
    write_jsonl(tmp_path / "train.jsonl", [record] * 5)
    write_jsonl(tmp_path / "eval.jsonl", [record] * 5)
    rc = resolve_config(
        parse_config(
            {
                "model": {"init": "random", "family": "qwen3_vl"},
                "reward": {"functions": {"exact_match": 1.0}},
                "data": {"paths": ["train.jsonl"], "num_samples": 1},
                "eval": {"paths": ["eval.jsonl"], "num_samples": 3},
            }
        )
    )
    train = load_run_data(rc, ImageStore(), base_dir=tmp_path)
    held_out = load_run_data(rc, ImageStore(), base_dir=tmp_path, split="eval")
    assert len(train.examples) == 1
    assert [e.id for e in held_out.examples] == ["eval.jsonl:1", "eval.jsonl:2", "eval.jsonl:3"]


# -- hostile records: deep nesting, folders, answers no reward can read, names that look like base64 ----------
@pytest.mark.parametrize("depth", [5000, 100])
def test_a_record_nested_too_deeply_is_an_error_naming_the_record(tmp_path, depth):
    """5000 levels used to raise an unhandled RecursionError from the JSON reader; 100 parse but are refused too."""
    deep = "[" * depth + "]" * depth
    write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"messages": [{"role": "user", "content": "hi"}], "answer": "a"},
            '{"messages": [{"role": "user", "content": "hi"}], "answer": "a", "extra": ' + deep + "}",
        ],
    )
    message = load_error(DataError, tmp_path, ["d.jsonl"])
    assert message.startswith("d.jsonl:2: arrays and objects nested") and "64" in message


def test_a_record_nested_as_deep_as_the_limit_loads(tmp_path):
    nested: Any = "leaf"
    for _ in range(62):  # with the record and its key: 63 levels of objects and arrays
        nested = [nested]
    write_jsonl(
        tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}], "answer": "a", "extra": nested}]
    )
    loaded, _ = load(tmp_path, ["d.jsonl"])
    assert loaded.examples[0].metadata["extra"] == nested


@pytest.mark.parametrize("on_bad_image", ["error", "skip"])
def test_an_image_path_that_is_a_folder_is_a_bad_image_naming_the_record(data_dir, on_bad_image):
    """It used to raise an unhandled IsADirectoryError; now it is a bad image like any other (skipped with skip)."""
    write_jsonl(
        data_dir / "data" / "train.jsonl",
        [
            {"messages": [user({"type": "image_url", "image_url": "images"})], "answer": "a"},
            {"messages": [user({"type": "image", "image": "images/green.png"})], "answer": "green"},
        ],
    )
    if on_bad_image == "error":
        message = load_error(ImageError, data_dir, ["data/train.jsonl"])
        assert (
            message
            == f"data/train.jsonl:1 messages[0].content[0].image_url: image path {data_dir / 'data' / 'images'} is a "
            "folder, not an image file"
        )
        return
    loaded, _ = load(data_dir, ["data/train.jsonl"], on_bad_image="skip")
    assert [e.id for e in loaded.examples] == ["data/train.jsonl:2"]
    assert loaded.skipped == [
        SkippedRecord(
            "data/train.jsonl:1",
            "messages[0].content[0].image_url: image path "
            f"{data_dir / 'data' / 'images'} is a folder, not an image file",
        )
    ]


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("NaN", "d.jsonl:1 answer: the answer is nan, which no reward can compare"),
        ("-Infinity", "d.jsonl:1 answer: the answer is -inf"),
        ("[1, NaN]", "d.jsonl:1 answer[1]: the answer is nan"),
        ('{"answer": NaN, "choices": ["A"]}', "d.jsonl:1 answer.answer: the answer is nan"),
        ('{"a": 1}', "d.jsonl:1 answer: the answer is an object without an 'answer' key (keys: a)"),
        (
            '{"choices": ["A", "B"]}',
            "d.jsonl:1 answer: the answer is an object without an 'answer' key (keys: choices)",
        ),
        ('{"answer": {"x": 1}}', "d.jsonl:1 answer.answer: expected a string, number or array, got an object"),
    ],
    ids=["nan", "-inf", "nan in an array", "nan in an object", "an object", "choices alone", "a nested object"],
)
def test_an_answer_no_reward_can_read_is_an_error_naming_the_record(tmp_path, answer, expected):
    """NaN and objects without an ``answer`` key used to be accepted silently (every reward then scored 0)."""
    (tmp_path / "d.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}], "answer": ' + answer + "}\n")
    assert load_error(DataError, tmp_path, ["d.jsonl"]).startswith(expected)


def test_answers_the_rewards_read_are_accepted(tmp_path):
    answers = ["cat", 3, 0.5, True, [1, 2], {"answer": "B", "choices": ["A", "B"]}, {"answer": 12, "unit": "cm"}]
    write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}], "answer": a} for a in answers])
    loaded, _ = load(tmp_path, ["d.jsonl"])
    assert [e.answer for e in loaded.examples] == answers


def test_a_relative_path_that_looks_like_base64_is_read_as_a_path_when_the_file_exists(data_dir):
    """``QkGreen`` starts as base64 of a BMP does, ``images/../iVBORw0KGgoBlue`` as a PNG's: a file of that name
    wins, as in transformers' ``load_image``; with no such file the text is still read as base64."""
    (data_dir / "data" / "QkGreen").write_bytes(GREEN)
    (data_dir / "data" / "iVBORw0KGgoBlue").write_bytes(BLUE)
    write_jsonl(
        data_dir / "data" / "train.jsonl",
        [
            {
                "messages": [
                    user({"type": "image_url", "image_url": "QkGreen"}, {"type": "image", "image": "iVBORw0KGgoBlue"})
                ],
                "answer": "green",
            },
            {"messages": [user({"type": "image", "image": base64.b64encode(RED).decode()})], "answer": "red"},
        ],
    )
    loaded, store = load(data_dir, ["data/train.jsonl"])
    first, second = loaded.examples
    assert [colour(store, i) for i in first.image_ids()] == [(0, 255, 0), (0, 0, 255)]
    assert [colour(store, i) for i in second.image_ids()] == [(255, 0, 0)]
