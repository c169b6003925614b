"""The ``colour`` task: which of red, green and blue is the large shape in a 64x64 image?

Built so that a tiny random VLM can learn it by RL on a CPU in minutes. The prompt is the same for every
sample; only the image changes. The shape covers 45-97% of the image (each of the 4 image tokens a
64x64 image becomes sees it) on a grey background, so the colour is the dominant pixel signal. The answers
``Red``, ``Green`` and ``Blue`` are one token each in the bundled tiny tokenizer, the very tokens the prompt
names; chance reward is 1/3.
"""

from __future__ import annotations

from random import Random
from typing import TYPE_CHECKING, Any

from vlmreg.sdk.task import Task
from vlmreg.tasks.drawing import SHAPES, Colour, draw_shape, one_image_examples

if TYPE_CHECKING:
    from vlmreg.sdk.example import Example

__all__ = ["COLOURS", "PROMPT", "SIZE", "TASK", "colour_image", "generate"]

NAME = "colour"
SIZE = 64
#: Each answer and the RGB channel that carries it.
COLOURS: dict[str, int] = {"Red": 0, "Green": 1, "Blue": 2}
PROMPT = "What colour is the shape? Red, Green or Blue?"


def _shade(rng: Random, channel: int) -> Colour:
    """A saturated shade: the answer's channel high (170-255), the other two low (0-80)."""
    values = [rng.randint(0, 80) for _ in range(3)]
    values[channel] = rng.randint(170, 255)
    return values[0], values[1], values[2]


def colour_image(rng: Random) -> tuple[Any, str, str]:
    """One image, its answer (``Red``, ``Green`` or ``Blue``) and its shape's kind."""
    # deferred: start-up cost (loads PIL)
    from PIL import Image, ImageDraw  # noqa: PLC0415

    answer = rng.choice(list(COLOURS))
    shape = rng.choice(SHAPES)
    grey = rng.randint(0, 255)
    image = Image.new("RGB", (SIZE, SIZE), (grey, grey, grey))
    side = rng.randint(52, 62) if shape != "triangle" else rng.randint(60, 63)
    left, top = rng.randint(0, SIZE - 1 - side), rng.randint(0, SIZE - 1 - side)
    draw_shape(ImageDraw.Draw(image), shape, (left, top, left + side, top + side), _shade(rng, COLOURS[answer]))
    return image, answer, shape


def generate(n: int, seed: int, store: Any) -> list[Example]:
    """``n`` samples for ``seed``; images go into ``store`` (an `ImageStore`)."""

    def make(rng: Any) -> tuple[Any, str, dict[str, Any]]:
        image, answer, shape = colour_image(rng)
        return image, answer, {"shape": shape, "choices": list(COLOURS)}

    return one_image_examples(NAME, PROMPT, n, seed, store, make)


TASK = Task(
    name=NAME,
    generate=generate,
    reward={"first_word": 1.0},
    description="A 64x64 image with one large red, green or blue shape; answer the colour in one word. "
    "Learnable by a tiny model on a CPU in minutes; chance reward 1/3.",
    choices=tuple(COLOURS),
)
