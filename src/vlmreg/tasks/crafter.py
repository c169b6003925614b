"""The ``crafter`` task: Crafter (Hafner, 2021), an open-world survival game, played from its 64x64 frames.

Each episode is one Crafter world (its seed from the example); every turn the model sees the current frame and
answers with one of Crafter's 17 actions by name (``move_left``, ``do``, ``place_table``, ...); the reward is the
game's (+1 for each achievement unlocked the first time, -0.1/+0.1 as health falls or recovers). Episodes end when
the player dies or after `MAX_STEPS` moves. Per episode, ``info`` reports ``episode_length``, ``episode_return`` and
the ``achievements`` unlocked. Played through the gymnasium adapter (`vlmreg.envs.gym`); needs ``pip install
crafter`` (imported only when an episode starts). The task's ``reward`` is unused: the game scores itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlmreg.envs.gym import gym_environment
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.example import Example
from vlmreg.sdk.task import Task

if TYPE_CHECKING:
    from vlmreg.sdk.example import Example

__all__ = ["ACTIONS", "ENVIRONMENT", "MAX_STEPS", "TASK", "CrafterGame", "generate"]

NAME = "crafter"
SIZE = 64
MAX_STEPS = 32
#: Crafter's actions, in its own order (``crafter.constants.actions``): the answer's first word picks one.
ACTIONS = (
    "noop",
    "move_left",
    "move_right",
    "move_up",
    "move_down",
    "do",
    "sleep",
    "place_stone",
    "place_table",
    "place_furnace",
    "place_plant",
    "make_wood_pickaxe",
    "make_stone_pickaxe",
    "make_iron_pickaxe",
    "make_wood_sword",
    "make_stone_sword",
    "make_iron_sword",
)
PROMPT = f"You play Crafter: survive and unlock achievements. Answer with one action: {', '.join(ACTIONS)}."
FOLLOW_UP = "Next action?"


class CrafterGame:
    """Crafter behind the gymnasium API the adapter expects (Crafter itself keeps gym's older one)."""

    def __init__(self, size: int = SIZE) -> None:
        try:
            # deferred: optional, its absence is handled here
            import crafter  # noqa: PLC0415
        except ImportError:
            raise VlmregError("the crafter environment needs the crafter package: pip install crafter") from None
        self._crafter, self.size = crafter, size
        self.env: Any = None

    def reset(self, seed: int | None = None, options: Any = None) -> tuple[Any, dict[str, Any]]:
        self.env = self._crafter.Env(size=(self.size, self.size), seed=seed)
        return self.env.reset(), {}

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        observation, reward, done, info = self.env.step(action)
        return observation, float(reward), bool(done), False, info


def generate(n: int, seed: int, store: Any) -> list[Example]:
    """``n`` worlds: each example's seed picks its Crafter world (the frames come from the game, not the store)."""

    return [
        Example(
            id=f"{NAME}:{index}",
            messages=[{"role": "user", "content": PROMPT}],
            answer=None,
            task=NAME,
            metadata={"seed": (seed * 1_000_003 + index) % 2**31, "index": index},
        )
        for index in range(n)
    ]


ENVIRONMENT = gym_environment(
    NAME,
    CrafterGame,
    actions={name: index for index, name in enumerate(ACTIONS)},
    prompt=PROMPT,
    follow_up=FOLLOW_UP,
    max_steps=MAX_STEPS,
    frame="observation",
    description=f"Crafter from its {SIZE}x{SIZE} frames, one action a turn, at most {MAX_STEPS} (needs: pip install "
    "crafter).",
)

TASK = Task(
    name=NAME,
    generate=generate,
    reward={"first_word": 1.0},
    environment=ENVIRONMENT,
    choices=ACTIONS,
    description=f"Crafter worlds played from {SIZE}x{SIZE} frames, one action by name a turn; the game's reward. "
    "Needs: pip install crafter.",
)
