"""The ``count`` task: how many shapes (1 to 6) are in a 128x128 image? The number goes in ``\\boxed{}``.

Shapes (circles, squares, triangles, 14-26 px, in saturated colours) are placed on a white background
with at least 4 px between their boxes, so each is its own connected region and the count is exact.
Scored by the ``math`` reward.
"""

from __future__ import annotations

from random import Random
from typing import TYPE_CHECKING, Any

from vlmreg.sdk.task import Task
from vlmreg.tasks.drawing import SHAPES, Box, draw_shape, one_image_examples

if TYPE_CHECKING:
    from vlmreg.sdk.example import Example

__all__ = ["MAX_SHAPES", "PROMPT", "SIZE", "TASK", "count_image", "generate"]

NAME = "count"
SIZE = 128
MAX_SHAPES = 6
GAP = 4
BACKGROUND = (255, 255, 255)
PALETTE = ((220, 40, 40), (40, 160, 60), (40, 80, 220), (230, 170, 0), (150, 50, 190), (0, 160, 170), (30, 30, 30))
PROMPT = "How many shapes are there? Put the number in \\boxed{}."


def _apart(box: Box, others: list[Box]) -> bool:
    """Whether ``box`` keeps at least `GAP` pixels from every box in ``others``."""
    left, top, right, bottom = box
    return all(
        left > o_right + GAP or right < o_left - GAP or top > o_bottom + GAP or bottom < o_top - GAP
        for o_left, o_top, o_right, o_bottom in others
    )


def _place(rng: Random, count: int) -> list[Box]:
    """``count`` non-touching square boxes inside the image (rejection sampling; 6 small boxes always fit)."""
    for _ in range(100):
        boxes: list[Box] = []
        for _ in range(50 * count):
            side = rng.randint(14, 26)
            left, top = rng.randint(1, SIZE - 2 - side), rng.randint(1, SIZE - 2 - side)
            box = (left, top, left + side, top + side)
            if _apart(box, boxes):
                boxes.append(box)
                if len(boxes) == count:
                    return boxes
    raise RuntimeError(f"could not place {count} shapes in a {SIZE}x{SIZE} image")


def count_image(rng: Random) -> tuple[Any, int, list[str]]:
    """One image, how many shapes it shows, and their kinds."""
    # deferred: start-up cost (loads PIL)
    from PIL import Image, ImageDraw  # noqa: PLC0415

    count = rng.randint(1, MAX_SHAPES)
    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    shapes = [rng.choice(SHAPES) for _ in range(count)]
    for shape, box in zip(shapes, _place(rng, count), strict=True):
        draw_shape(draw, shape, box, rng.choice(PALETTE))
    return image, count, shapes


def generate(n: int, seed: int, store: Any) -> list[Example]:
    """``n`` samples for ``seed``; images go into ``store`` (an `ImageStore`). The answer is an int."""

    def make(rng: Any) -> tuple[Any, int, dict[str, Any]]:
        image, count, shapes = count_image(rng)
        return image, count, {"shapes": shapes}

    return one_image_examples(NAME, PROMPT, n, seed, store, make)


TASK = Task(
    name=NAME,
    generate=generate,
    reward={"math": 1.0},
    description="A 128x128 image with 1 to 6 separate shapes; answer how many, as \\boxed{N}. Harder than colour.",
    choices=tuple(f"\\boxed{{{n}}}" for n in range(1, MAX_SHAPES + 1)),
)
