"""Gymnasium-style games as multi-turn vlmreg environments: an RGB frame every turn, text answers mapped to actions.

`GymEnvironment` wraps any object with the gymnasium API (``reset(seed=) -> (obs, info)``, ``step(action) -> (obs,
reward, terminated, truncated, info)``, and ``render()`` when the frame is not the observation); gymnasium itself is
not imported, so a game needs only its own package. Each turn the frame (an ``(H, W, 3)`` uint8 array, from the
observation or from ``render()``) goes into the run's `ImageStore` and the model sees it with a prompt; its answer's
first word is looked up in ``actions`` (a name -> action mapping, case-insensitive; or a callable returning the action
or ``None``). An answer that is no action earns ``invalid_reward`` and a text reminder of the moves, and does not move
the game. The episode ends when the game terminates or truncates, or after ``max_steps`` moves. The environment's
reward is the game's, whatever the run's ``[reward]`` says.

Per episode, the last step's ``info`` (merged into the trajectory's) holds ``episode_length``, ``episode_return``,
``invalid_actions`` and, when the game reports them (Crafter does), ``achievements``: the names unlocked so far.
Use `gym_environment` to register one.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from typing import Any

from vlmreg.sdk.environment import EnvironmentSpec, EnvStep
from vlmreg.sdk.errors import VlmregError

__all__ = ["GymEnvironment", "frame_to_image", "gym_environment"]

Actions = Mapping[str, Any] | Callable[[str], Any]


def frame_to_image(frame: Any, size: int | None = None) -> Any:
    """An RGB ``(H, W, 3)`` uint8 array (or a PIL image) as an RGB PIL image, resized to ``size`` x ``size`` if
    given."""
    # deferred: start-up cost (loads PIL)
    from PIL import Image  # noqa: PLC0415

    if isinstance(frame, Image.Image):
        image = frame.convert("RGB")
    else:
        # deferred: start-up cost (loads numpy)
        import numpy as np  # noqa: PLC0415

        array = np.asarray(frame)
        if array.ndim != 3 or array.shape[2] not in (3, 4) or array.dtype != np.uint8:
            raise VlmregError(f"a frame must be an (H, W, 3) uint8 RGB array; got shape {array.shape} of {array.dtype}")
        image = Image.fromarray(np.ascontiguousarray(array[:, :, :3]), "RGB")
    if size is not None and image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.NEAREST)
    return image


def _first_word(text: str) -> str:
    match = re.search(r"[A-Za-z0-9_\-]+", text)
    return match.group(0).lower() if match else ""


class GymEnvironment:
    """One episode of a gymnasium-style game ``game`` (a fresh one per episode)."""

    def __init__(
        self,
        game: Any,
        store: Any,
        *,
        actions: Actions,
        prompt: str,
        follow_up: str = "What next?",
        max_steps: int = 50,
        frame: str = "render",
        size: int | None = None,
        invalid_reward: float = 0.0,
        name: str | None = None,
    ) -> None:
        if frame not in ("render", "observation"):
            raise VlmregError(f"frame must be 'render' or 'observation', not {frame!r}")
        self.game, self.store, self.actions, self.prompt, self.follow_up = game, store, actions, prompt, follow_up
        self.max_steps, self.frame, self.size, self.invalid_reward = max_steps, frame, size, invalid_reward
        if name:
            self.name = name

    # -- what the model sees -----------------------------------------------------------------
    def moves(self) -> str:
        return ", ".join(self.actions) if isinstance(self.actions, Mapping) else "see the prompt"

    def _image(self, observation: Any) -> str:
        raw = observation if self.frame == "observation" else self.game.render()
        if raw is None:
            raise VlmregError(
                "the game's render() returned None; make it with render_mode='rgb_array', or use frame='observation'"
            )
        return self.store.add(frame_to_image(raw, self.size))

    def _message(self, observation: Any, text: str) -> dict[str, Any]:
        return {
            "role": "user",
            "content": [{"type": "image", "image": self._image(observation)}, {"type": "text", "text": text}],
        }

    def _action(self, completion: str) -> Any:
        if callable(self.actions) and not isinstance(self.actions, Mapping):
            return self.actions(completion)
        lookup = {k.lower(): v for k, v in self.actions.items()}
        return lookup.get(_first_word(completion))

    # -- the protocol ----------------------------------------------------------------------------
    def reset(self, example: Any) -> list[dict[str, Any]]:
        seed = (example.metadata or {}).get("seed") if hasattr(example, "metadata") else None
        if not isinstance(seed, int):  # the example's id decides the game's seed: the same episode in every process
            seed = int.from_bytes(hashlib.sha256(str(example.id).encode()).digest()[:4], "big")
        observation, _ = self.game.reset(seed=seed)
        self.steps, self.total, self.invalid = 0, 0.0, 0
        self.unlocked: set[str] = set()
        return [self._message(observation, self.prompt)]

    def step(self, completion: str) -> Any:
        action = self._action(completion)
        if action is None:
            self.invalid += 1
            self.steps += 1
            done = self.steps >= self.max_steps
            reply = {"role": "user", "content": f"That is not a move. Moves: {self.moves()}."}
            return EnvStep(reward=self.invalid_reward, done=done, messages=() if done else (reply,), info=self._info())
        observation, reward, terminated, truncated, info = self.game.step(action)
        self.steps += 1
        self.total += float(reward)
        achievements = (info or {}).get("achievements")
        if isinstance(achievements, Mapping):  # Crafter: name -> times unlocked
            self.unlocked |= {k for k, v in achievements.items() if v}
        done = bool(terminated or truncated) or self.steps >= self.max_steps
        messages = () if done else (self._message(observation, self.follow_up),)
        return EnvStep(reward=float(reward), done=done, messages=messages, info=self._info())

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "episode_length": self.steps,
            "episode_return": self.total,
            "invalid_actions": self.invalid,
        }
        if self.unlocked:
            info["achievements"] = sorted(self.unlocked)
        return info

    def close(self) -> None:
        close = getattr(self.game, "close", None)
        if callable(close):
            close()


def gym_environment(
    name: str,
    make_game: Callable[[], Any],
    *,
    actions: Actions,
    prompt: str,
    description: str = "",
    **options: Any,
) -> EnvironmentSpec:
    """An `EnvironmentSpec` for a gymnasium-style game: ``make_game()`` gives a fresh game per episode; ``options``
    go to `GymEnvironment` (``follow_up``, ``max_steps``, ``frame``, ``size``, ``invalid_reward``)."""

    def make(example: Any, reward: Any, store: Any) -> GymEnvironment:
        return GymEnvironment(make_game(), store, actions=actions, prompt=prompt, name=name, **options)

    return EnvironmentSpec(
        name=name, make=make, description=description or f"the game {name}: a frame each turn, text moves"
    )
