"""The ``colour_order`` task: a short clip turns from one colour to another; which colour came first?

A task that needs time: every frame is one flat colour, so any one frame shows a single colour and cannot tell whether
it is the first or the second; the answer needs the frames in their order. Each clip is `FRAMES` frames of
`SIZE` x `SIZE` at `FPS` frames a second (given as a video, so the family's processor writes its timestamps or frame
markers): colour A for the first half of the frames, then colour B, A and B two different ones of red, green and
blue, in random saturated shades. (Switching half-way keeps each temporal patch of two frames, as video processors
commonly merge them, one colour.) The order makes it harder for a tiny random model than ``missing_colour`` (same
clips, an order-free question): see BENCHMARKS.md. The answers ``Red``, ``Green`` and ``Blue`` are one token each in the
bundled tiny tokenizer, the very tokens the prompt names; chance reward is 1/3. Only families that declare video
(``max_videos_per_message > 0``) can run it; the others refuse its examples naming the family.
"""

from __future__ import annotations

from random import Random
from typing import Any

from vlmreg.sdk.example import Example, text_part
from vlmreg.sdk.task import Task
from vlmreg.sdk.video import video_part
from vlmreg.tasks.drawing import sample_rng

__all__ = ["FRAMES", "PROMPT", "TASK", "clip", "generate"]

NAME = "colour_order"
SIZE = 64
FRAMES = 4
FPS = 2.0
COLOURS: dict[str, int] = {"Red": 0, "Green": 1, "Blue": 2}
PROMPT = "Which colour comes first? Red, Green or Blue?"


def _shade(rng: Random, channel: int) -> tuple[int, int, int]:
    """A saturated shade: the colour's channel high (170-255), the other two low (0-80)."""
    values = [rng.randint(0, 80) for _ in range(3)]
    values[channel] = rng.randint(170, 255)
    return values[0], values[1], values[2]


def clip(rng: Random) -> tuple[list[Any], str, str, int]:
    """The frames of one clip, its first colour (the answer), its second, and how many frames show the first."""
    # deferred: start-up cost (loads PIL)
    from PIL import Image  # noqa: PLC0415

    first, second = rng.sample(list(COLOURS), 2)
    switch = FRAMES // 2
    shades = (_shade(rng, COLOURS[first]), _shade(rng, COLOURS[second]))
    frames = [Image.new("RGB", (SIZE, SIZE), shades[0] if k < switch else shades[1]) for k in range(FRAMES)]
    return frames, first, second, switch


def generate(n: int, seed: int, store: Any) -> list[Example]:
    """``n`` samples for ``seed``; each clip's frames go into ``store`` (an `ImageStore`) as one video."""
    # deferred: start-up cost (loads http, ssl, urllib.request)
    from vlmreg.data.video import DecodedVideo  # noqa: PLC0415

    examples = []
    for index in range(n):
        frames, first, second, switch = clip(sample_rng(NAME, seed, index))
        video_id = store.add_video(DecodedVideo(tuple(frames), FPS, FRAMES, tuple(range(FRAMES))))
        examples.append(
            Example(
                id=f"{NAME}:{index}",
                messages=[{"role": "user", "content": [video_part(video_id), text_part(PROMPT)]}],
                answer=first,
                task=NAME,
                metadata={"seed": seed, "index": index, "second": second, "switch": switch, "choices": list(COLOURS)},
            )
        )
    return examples


TASK = Task(
    name=NAME,
    generate=generate,
    reward={"first_word": 1.0},
    description=f"A {FRAMES}-frame clip turns from one of red, green and blue to another; answer the first colour in "
    "one word. One frame cannot tell (each shows one colour); needs a family that takes video. Chance reward 1/3.",
    choices=tuple(COLOURS),
)
