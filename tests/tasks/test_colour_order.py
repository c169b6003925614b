"""The ``colour_order`` video task: its clips and answers (its refusal and a training run: test_missing_colour, which
shares its clips)."""

from __future__ import annotations

import vlmreg
from vlmreg.data import ImageStore
from vlmreg.tasks import colour_order

CHANNEL = {"Red": 0, "Green": 1, "Blue": 2}


def colour_of(image) -> str:
    pixel = image.getpixel((0, 0))
    return max(CHANNEL, key=lambda name: pixel[CHANNEL[name]])


def test_each_clip_turns_from_the_answer_to_another_colour_and_no_frame_alone_tells():
    store = ImageStore()
    examples = colour_order.generate(60, 0, store)
    seen: dict[str, set[bool]] = {}
    for example in examples:
        video = store.video(example.video_ids()[0])
        colours = [colour_of(store.get(f)) for f in video.frame_ids]
        switch = example.metadata["switch"]
        assert colours == [example.answer] * switch + [example.metadata["second"]] * (colour_order.FRAMES - switch)
        assert example.answer != example.metadata["second"] and video.fps == colour_order.FPS
        for colour in colours:  # a frame's colour, without its place in the clip: the answer, or not
            seen.setdefault(colour, set()).add(colour == example.answer)
    assert all(outcomes == {True, False} for outcomes in seen.values()) and len(seen) == 3
    assert {e.answer for e in examples} == set(CHANNEL) and {e.metadata["switch"] for e in examples} == {
        colour_order.FRAMES // 2
    }
    assert [p["type"] for p in examples[0].messages[0]["content"]] == ["video", "text"]
    again = colour_order.generate(60, 0, ImageStore())
    assert [e.video_ids() for e in again] == [e.video_ids() for e in examples]  # ids are content hashes
    assert vlmreg.get_task_registry().get("colour_order") is colour_order.TASK
