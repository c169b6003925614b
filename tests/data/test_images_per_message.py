"""A dataset message with more images than the family takes is refused naming the record, not silently cut."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from vlmreg.cli import main


@pytest.mark.parametrize("count, ok", [(16, True), (17, False), (100, False)])
def test_images_per_message_are_checked_against_the_family(tmp_path, capsys, count, ok):
    Image.new("RGB", (32, 32), (255, 0, 0)).save(tmp_path / "r.png")
    content = [{"type": "image", "image": "r.png"}] * count + [{"type": "text", "text": "Which colour?"}]
    records = [
        {"messages": [{"role": "user", "content": "warm up"}], "answer": "Red"},
        {"messages": [{"role": "user", "content": content}], "answer": "Red"},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = tmp_path / "c.toml"
    config.write_text(
        '[model]\ninit = "random"\nfamily = "qwen3_vl"\n[data]\npaths = ["d.jsonl"]\n[reward]\nfunctions = '
        "{exact_match = 1.0}\n"
    )
    code = main(["data", "preview", str(config)])
    err = capsys.readouterr().err
    if ok:
        assert code == 0, err
    else:
        assert code == 1 and "Traceback" not in err
        assert (
            f"d.jsonl:2: messages[0] carries {count} images; family qwen3_vl takes at most 16 per message"
            in " ".join(err.split())
        )
