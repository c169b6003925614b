"""`vlmreg data preview` of a video task: each clip one marker with its frames, size and tokens."""

from __future__ import annotations

import re

from tests.cli.test_data_cmds import preview_json, write_config


def test_preview_of_the_video_task_shows_each_clip_as_one_marker_with_its_tokens(tmp_path, capsys):
    config = write_config(tmp_path, 'task = "missing_colour"\nnum_samples = 3', reward=False)
    record = preview_json(capsys, config, "--n", "1")
    [sample] = record["samples"]
    [message] = sample["messages"]
    marker = re.match(
        r"\[video 4 frames 64x64, (\d+) tokens\] Which colour never appears\? Red, Green or Blue\?$", message["text"]
    )
    assert marker and message["images"] == []
    assert "seconds>" in sample["model_text"]  # the processor's timestamps, as the model reads them
    assert record["image_tokens"] == 3 * int(marker.group(1))
