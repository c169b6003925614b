"""The ``missing_colour`` task: a short clip turns from one colour to another; which of red, green and blue never
appears?

A task that needs time: the clips are `vlmreg.tasks.colour_order`'s (`FRAMES` flat-coloured frames, colour A for the
first half, then colour B), so any one frame shows a single colour and leaves two candidates (1/2); the answer needs
the frames of both halves. Unlike ``colour_order``'s question it does not depend on their order, which is why a tiny
random model learns it on a CPU in minutes. Chance reward is 1/3; only families that declare video run it.
"""

from __future__ import annotations

from typing import Any

from vlmreg.sdk.example import Example, text_part
from vlmreg.sdk.task import Task
from vlmreg.sdk.video import video_part
from vlmreg.tasks import colour_order
from vlmreg.tasks.colour_order import COLOURS, FPS, FRAMES, SIZE
from vlmreg.tasks.drawing import sample_rng

__all__ = ["FRAMES", "FPS", "PROMPT", "SIZE", "TASK", "generate"]

NAME = "missing_colour"
PROMPT = "Which colour never appears? Red, Green or Blue?"


def generate(n: int, seed: int, store: Any) -> list[Example]:
    """``n`` samples for ``seed``; each clip's frames go into ``store`` (an `ImageStore`) as one video."""
    # deferred: start-up cost (loads http, ssl, urllib.request)
    from vlmreg.data.video import DecodedVideo  # noqa: PLC0415

    examples = []
    for index in range(n):
        frames, first, second, switch = colour_order.clip(sample_rng(NAME, seed, index))
        [missing] = [name for name in COLOURS if name not in (first, second)]
        video_id = store.add_video(DecodedVideo(tuple(frames), FPS, FRAMES, tuple(range(FRAMES))))
        examples.append(
            Example(
                id=f"{NAME}:{index}",
                messages=[{"role": "user", "content": [video_part(video_id), text_part(PROMPT)]}],
                answer=missing,
                task=NAME,
                metadata={
                    "seed": seed,
                    "index": index,
                    "first": first,
                    "second": second,
                    "switch": switch,
                    "choices": list(COLOURS),
                },
            )
        )
    return examples


TASK = Task(
    name=NAME,
    generate=generate,
    reward={"first_word": 1.0},
    description=f"A {FRAMES}-frame clip turns from one of red, green and blue to another; answer, in one word, the "
    "colour that never appears. One frame cannot tell (each shows one colour); needs a family that takes video. "
    "Chance 1/3.",
    choices=tuple(COLOURS),
)
