"""The ``missing_colour`` video task: its clips, its answers, a short training run of the shipped config, and its
refusal by a family without video."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import vlmreg
from vlmreg.cli import main
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.data import ImageStore
from vlmreg.sdk.errors import VlmregError
from vlmreg.tasks import missing_colour
from vlmreg.train.source import load_run_data

CONFIG = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_vl_video_tiny.toml")
CHANNEL = {"Red": 0, "Green": 1, "Blue": 2}


def colour_of(image) -> str:
    pixel = image.getpixel((0, 0))
    return max(CHANNEL, key=lambda name: pixel[CHANNEL[name]])


def test_each_clip_shows_two_colours_one_per_half_and_never_the_answer_and_no_frame_alone_tells():
    store = ImageStore()
    examples = missing_colour.generate(60, 0, store)
    seen: dict[str, set[bool]] = {}
    for example in examples:
        video = store.video(example.video_ids()[0])
        colours = [colour_of(store.get(f)) for f in video.frame_ids]
        switch = example.metadata["switch"]
        first, second = example.metadata["first"], example.metadata["second"]
        assert colours == [first] * switch + [second] * (missing_colour.FRAMES - switch)
        assert {first, second, example.answer} == set(CHANNEL) and video.fps == missing_colour.FPS
        for colour in colours:  # one frame's colour leaves two candidates: each turns out the answer
            seen.setdefault(colour, set()).add(example.answer)
    assert all(len(answers) == 2 for answers in seen.values()) and len(seen) == 3
    assert {e.answer for e in examples} == set(CHANNEL) and {e.metadata["switch"] for e in examples} == {
        missing_colour.FRAMES // 2
    }
    assert [p["type"] for p in examples[0].messages[0]["content"]] == ["video", "text"]
    again = missing_colour.generate(60, 0, ImageStore())
    assert [e.video_ids() for e in again] == [e.video_ids() for e in examples]  # ids are content hashes
    assert vlmreg.get_task_registry().get("missing_colour") is missing_colour.TASK


def test_a_family_without_video_refuses_the_task_naming_itself():
    rc = resolve_config(
        parse_config(
            {"model": {"init": "random", "family": "gemma3"}, "data": {"task": "missing_colour", "num_samples": 2}}
        )
    )
    with pytest.raises(
        VlmregError, match=r"missing_colour:0: messages\[0\] carries a video, but family gemma3 takes no video input"
    ):
        load_run_data(rc, ImageStore(), base_dir=Path("."))


def test_the_shipped_video_config_trains_a_few_steps(tmp_path):
    """A short version of the shipped run: warm-up, RL steps with video prompts through the embedded engine, eval."""
    out = tmp_path / "run"
    quick = [
        "--set",
        "trainer.steps=2",
        "--set",
        "trainer.format_warmup_steps=2",
        "--set",
        "trainer.prompts_per_step=4",
        "--set",
        "rollout.group_size=4",
        "--set",
        "eval.every=2",
        "--set",
        "eval.num_samples=8",
        "--set",
        "logging.rollout_page_every=0",
    ]
    assert main(["train", CONFIG, *quick, "--output-dir", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["samples"] > 0 and r["videos_dropped"] == 0 and 0.0 <= r["reward_mean"] <= 1.0 for r in records)
    assert "eval_reward_mean" in records[-1]
