"""The ``colour_turns`` task: a multi-turn episode whose environment answers with a new image each turn.

Turn 1 shows an image as the ``colour`` task does; after each answer the environment replies "And this
one?" with a new image, for three turns in all. Each correct turn earns 1/3. The trainer merges the turns
into one sample (the next prompt extends this prompt and completion token for token), so the images of
earlier turns are referred to again by id, never copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vlmreg.sdk.environment import EnvironmentSpec, EnvStep
from vlmreg.sdk.example import Example, image_part, text_part
from vlmreg.sdk.task import Task
from vlmreg.tasks.colour import COLOURS, PROMPT, colour_image
from vlmreg.tasks.drawing import sample_rng

if TYPE_CHECKING:
    from vlmreg.sdk.environment import EnvStep
    from vlmreg.sdk.example import Example

__all__ = ["ENVIRONMENT", "TASK", "TURNS", "ColourTurns", "generate"]

NAME = "colour_turns"
TURNS = 3
FOLLOW_UP = "And this one?"


def generate(n: int, seed: int, store: Any) -> list[Example]:
    """``n`` episodes: the first image in the prompt, the later ones (ids) and all answers in the metadata."""

    examples = []
    for index in range(n):
        rng = sample_rng(NAME, seed, index)
        images, answers = [], []
        for _ in range(TURNS):
            image, answer, _ = colour_image(rng)
            images.append(store.add(image))
            answers.append(answer)
        examples.append(
            Example(
                id=f"{NAME}:{index}",
                messages=[{"role": "user", "content": [image_part(images[0]), text_part(PROMPT)]}],
                answer=answers,
                task=NAME,
                metadata={"seed": seed, "index": index, "later_images": images[1:], "choices": list(COLOURS)},
            )
        )
    return examples


class ColourTurns:
    """Scores each answer against that turn's image and shows the next image until the last turn."""

    def __init__(self, example: Example, reward: Callable[[str, Any], float], store: Any = None) -> None:
        self.example, self.reward, self.turn = example, reward, 0  # the later images are in the store already

    def reset(self, example: Example) -> list[Any]:
        self.example, self.turn = example, 0
        return list(example.messages)

    def step(self, completion: str) -> EnvStep:
        answers = self.example.answer
        score = self.reward(completion, answers[self.turn]) / len(answers)
        self.turn += 1
        if self.turn == len(answers):
            return EnvStep(reward=score, done=True)
        image = self.example.metadata["later_images"][self.turn - 1]
        return EnvStep(
            reward=score, done=False, messages=[{"role": "user", "content": [image_part(image), text_part(FOLLOW_UP)]}]
        )


ENVIRONMENT = EnvironmentSpec(
    name=NAME,
    make=ColourTurns,
    reward={"first_word": 1.0},
    description=f"The colour question for {TURNS} turns, a new image each turn (plays colour_turns examples).",
)

TASK = Task(
    name=NAME,
    generate=generate,
    reward={"first_word": 1.0},
    environment=ENVIRONMENT,
    choices=tuple(COLOURS),
    description=f"{TURNS} turns of the colour question; after each answer the environment shows a new image. "
    f"Each correct turn earns 1/{TURNS}.",
)
