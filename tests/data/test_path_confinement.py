"""Dataset image paths are confined to the dataset file's folder and ``[data] image_roots``.

Every case writes a real config, real dataset files and real images under ``tmp_path`` and loads them as the
trainer does: `load_config` -> `resolve_config` -> `load_run_data` (which calls `load_examples`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.data.samples import png_bytes
from vlmreg.config import load_config
from vlmreg.config.load import ConfigError
from vlmreg.config.resolve import resolve_config
from vlmreg.config.schema import DataSection
from vlmreg.data import DataError, ImageError, ImageStore, load_examples
from vlmreg.data.images import ImagePathError
from vlmreg.train.source import load_run_data

GREEN, BLUE = png_bytes((8, 8), (0, 255, 0)), png_bytes((8, 8), (0, 0, 255))
SECRET = b"root:x:0:0:root:/root:/bin/bash\n"  # what a hostile record would like to read


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """``run/`` holds the config; ``run/data/`` the dataset and ``images/green.png``; ``outside/`` a secret and
    a real image that no dataset may reach; ``run/shared/blue.png`` an image for an extra root."""
    (tmp_path / "run" / "data" / "images").mkdir(parents=True)
    (tmp_path / "run" / "data" / "images" / "green.png").write_bytes(GREEN)
    (tmp_path / "run" / "shared").mkdir()
    (tmp_path / "run" / "shared" / "blue.png").write_bytes(BLUE)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_bytes(SECRET)
    (tmp_path / "outside" / "blue.png").write_bytes(BLUE)
    return tmp_path


def image_record(path: str) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": path}}, {"type": "text", "text": "What colour?"}]
    return {"messages": [{"role": "user", "content": parts}], "answer": "green"}


def write_dataset(tree: Path, *paths: str) -> None:
    lines = [json.dumps(image_record(p)) for p in paths]
    (tree / "run" / "data" / "train.jsonl").write_text("\n".join(lines) + "\n")


def load(tree: Path, *, paths: str = '["data/train.jsonl"]', extra: str = "") -> tuple[list[Any], ImageStore]:
    """Write ``run/config.toml`` and load its data exactly as `vlmreg train` does."""
    config = tree / "run" / "config.toml"
    config.write_text(
        '[model]\ninit = "random"\nfamily = "qwen3_vl"\n'
        f"[data]\npaths = {paths}\n{extra}\n"
        "[reward]\nfunctions = { exact_match = 1.0 }\n"
    )
    rc = resolve_config(load_config(config), source=str(config))
    store = ImageStore()
    data = load_run_data(rc, store, base_dir=config.resolve().parent)
    return data.examples, store


def colours(examples: list[Any], store: ImageStore) -> list[tuple[int, int, int]]:
    out = []
    for example in examples:
        for message in example.messages:
            for part in message["content"] if isinstance(message["content"], list) else ():
                if part.get("type") == "image":
                    out.append(store.get(part["image"]).getpixel((0, 0)))
    return out


def refused(tree: Path, **kwargs: Any) -> str:
    with pytest.raises(ImagePathError) as info:
        load(tree, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# -- accepted -------------------------------------------------------------------------------------------
def test_a_relative_path_inside_the_dataset_folder_is_read(tree):
    write_dataset(tree, "images/green.png", "./images/../images/green.png")
    examples, store = load(tree)
    assert colours(examples, store) == [(0, 255, 0), (0, 255, 0)]


def test_an_absolute_path_and_a_file_uri_inside_the_dataset_folder_are_read(tree):
    green = tree / "run" / "data" / "images" / "green.png"
    write_dataset(tree, str(green), green.as_uri())
    examples, store = load(tree)
    assert colours(examples, store) == [(0, 255, 0), (0, 255, 0)]


def test_a_path_under_an_extra_image_root_is_read(tree):
    blue = tree / "run" / "shared" / "blue.png"
    write_dataset(tree, "../shared/blue.png", str(blue), blue.as_uri())
    # Relative roots are resolved against the config file's folder (run/), not the cwd nor the dataset's folder.
    examples, store = load(tree, extra='image_roots = ["shared"]')
    assert colours(examples, store) == [(0, 0, 255)] * 3
    # The same dataset without the root is refused.
    assert "'../shared/blue.png'" in refused(tree)


def test_a_symlink_inside_pointing_inside_is_read(tree):
    (tree / "run" / "data" / "alias.png").symlink_to(tree / "run" / "data" / "images" / "green.png")
    write_dataset(tree, "alias.png")
    examples, store = load(tree)
    assert colours(examples, store) == [(0, 255, 0)]


# -- refused --------------------------------------------------------------------------------------------
def test_a_dotdot_escape_is_refused_naming_file_record_path_roots_and_the_key(tree):
    write_dataset(tree, "images/green.png", "../../outside/blue.png")
    message = refused(tree)
    data_dir = (tree / "run" / "data").resolve()
    assert message.startswith("data/train.jsonl:2 messages[0].content[0].image_url: ")  # the file, line 2, the field
    assert "image path '../../outside/blue.png'" in message  # the path as written
    assert f"resolves to {(tree / 'outside' / 'blue.png').resolve()}" in message
    assert f"outside the allowed image folders ({data_dir})" in message
    assert "add its folder to [data] image_roots" in message


def test_an_escape_is_refused_even_with_on_bad_image_skip(tree):
    write_dataset(tree, "images/green.png", "../../outside/blue.png")
    message = refused(tree, extra='on_bad_image = "skip"')
    assert message.startswith("data/train.jsonl:2 ")


@pytest.mark.parametrize("which", ["secret", "missing", "etc_passwd"])
def test_an_absolute_path_outside_is_refused_whether_or_not_it_exists(tree, which):
    target = {
        "secret": str(tree / "outside" / "secret.txt"),
        "missing": str(tree / "outside" / "nothing-here.png"),  # refused, not "not found": no existence oracle
        "etc_passwd": "/etc/passwd",
    }[which]
    write_dataset(tree, target)
    message = refused(tree)
    assert message.startswith("data/train.jsonl:1 messages[0].content[0].image_url: ")
    assert f"image path {target!r} resolves to " in message and "outside the allowed image folders" in message


def test_a_file_uri_outside_is_refused(tree):
    uri = (tree / "outside" / "blue.png").as_uri()
    write_dataset(tree, uri)
    assert f"image path {str(tree / 'outside' / 'blue.png')!r}" in refused(tree)


def test_a_symlink_inside_the_dataset_folder_pointing_outside_is_refused(tree):
    (tree / "run" / "data" / "images" / "innocent.png").symlink_to(tree / "outside" / "blue.png")
    (tree / "run" / "data" / "images" / "gone.png").symlink_to(tree / "outside" / "deleted.png")  # dangling
    (tree / "run" / "data" / "escape").symlink_to(tree / "outside", target_is_directory=True)
    for path in ("images/innocent.png", "images/gone.png", "escape/blue.png"):
        write_dataset(tree, path)
        message = refused(tree)
        assert message.startswith("data/train.jsonl:1 ") and f"image path {path!r} resolves to " in message
        assert str((tree / "outside").resolve()) in message


def test_an_extra_root_does_not_open_its_siblings(tree):
    write_dataset(tree, "../../outside/blue.png")
    message = refused(tree, extra='image_roots = ["shared"]')
    assert f"({(tree / 'run' / 'data').resolve()}, {(tree / 'run' / 'shared').resolve()})" in message


def test_a_parquet_path_cell_escaping_is_refused_naming_its_row(tree):
    schema = pa.schema(
        [
            ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
            ("prompt", pa.string()),
            ("answer", pa.string()),
        ]
    )
    rows = [
        {"images": [{"bytes": None, "path": "images/green.png"}], "prompt": "<image>Colour?", "answer": "green"},
        {"images": [{"bytes": None, "path": "../../outside/secret.txt"}], "prompt": "<image>Colour?", "answer": "x"},
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tree / "run" / "data" / "geo.parquet")
    with pytest.raises(ImagePathError) as info:
        load(tree, paths='["data/geo.parquet"]', extra='format = "placeholder"')
    assert str(info.value).startswith(
        "data/geo.parquet:1 images[0]: image path '../../outside/secret.txt' resolves to "
    )


def test_the_refusal_is_an_image_error_and_does_not_decode_what_is_outside(tree):
    write_dataset(tree, "../../outside/secret.txt")  # not an image: reading it would say "not an image"
    with pytest.raises(ImageError) as info:
        load(tree)
    assert isinstance(info.value, ImagePathError)
    assert "not an image" not in str(info.value) and "outside the allowed image folders" in str(info.value)


# -- image_roots itself ------------------------------------------------------------------------------------
def test_a_missing_or_non_folder_image_root_is_reported_by_validation_naming_the_key(tree):
    write_dataset(tree, "images/green.png")
    with pytest.raises(ConfigError) as info:
        load(tree, extra='image_roots = ["shared", "no-such-folder", "data/train.jsonl"]')
    problems = info.value.problems
    run = (tree / "run").resolve()
    assert problems == [
        (
            f"data.image_roots[1]: 'no-such-folder' (looked for {run / 'no-such-folder'}) does not exist; list "
            "existing image folders"
        ),
        (
            f"data.image_roots[2]: 'data/train.jsonl' (looked for {run / 'data' / 'train.jsonl'}) is not a directory; "
            "list image folders"
        ),
    ]


def test_the_loader_checks_image_roots_too(tree):
    write_dataset(tree, "images/green.png")
    section = DataSection(paths=["data/train.jsonl"], image_roots=["no-such-folder"])
    with pytest.raises(DataError) as info:
        load_examples(section, ImageStore(), base_dir=tree / "run")
    assert str(info.value) == (
        f"[data] image_roots[0]: image folder not found: no-such-folder (looked for {tree / 'run' / 'no-such-folder'})"
    )
