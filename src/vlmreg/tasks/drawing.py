"""What the bundled tasks share: one random generator per sample, and simple filled shapes drawn with PIL.

Each sample draws from its own generator, seeded by ``(task, seed, index)``, so sample ``i`` is the same
whatever ``n`` is asked for, and the same in every process (string seeds do not depend on ``PYTHONHASHSEED``).
PIL draws without anti-aliasing, so every shape is one solid, connected region of a single colour.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["SHAPES", "Box", "Colour", "draw_shape", "one_image_examples", "sample_rng"]

SHAPES = ("circle", "square", "triangle")

Box = tuple[int, int, int, int]
Colour = tuple[int, int, int]


def sample_rng(task: str, seed: int, index: int) -> random.Random:
    """The generator for sample ``index`` of ``task`` under ``seed``."""
    return random.Random(f"{task}:{seed}:{index}")


def one_image_examples(task: str, prompt: str, n: int, seed: int, store: Any, make: Any) -> list[Any]:
    """``n`` single-turn examples: ``make(rng) -> (image, answer, metadata)`` per sample, the image then ``prompt``."""
    # deferred: not at import: the plugin loads with the registry
    from vlmreg.sdk.example import Example, image_part, text_part  # noqa: PLC0415

    examples = []
    for index in range(n):
        image, answer, metadata = make(sample_rng(task, seed, index))
        content = [image_part(store.add(image)), text_part(prompt)]
        examples.append(
            Example(
                id=f"{task}:{index}",
                messages=[{"role": "user", "content": content}],
                answer=answer,
                task=task,
                metadata={"seed": seed, "index": index, **metadata},
            )
        )
    return examples


def draw_shape(draw: Any, shape: str, box: Box, fill: Colour) -> None:
    """Draw a filled ``shape`` inside ``box`` (left, top, right, bottom; inclusive) on a PIL ``ImageDraw``."""
    left, top, right, bottom = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(left, bottom), (right, bottom), ((left + right) // 2, top)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; shapes: {', '.join(SHAPES)}")
