"""The gymnasium adapter: a game with RGB frames and text moves plays as a multi-turn environment, in process, with
the tiny model under an image budget, and over HTTP. gymnasium itself is optional (the last test needs it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vlmreg
from vlmreg.config import parse_config
from vlmreg.data import Example, ImageStore
from vlmreg.envs.gym import GymEnvironment, frame_to_image, gym_environment
from vlmreg.envs.remote import RemoteEnvironments
from vlmreg.envs.server import EnvServer
from vlmreg.inference.embedded import EmbeddedEngine
from vlmreg.rollout.episodes import run_episodes
from vlmreg.sdk.engine import ChatTurn, Completion, EncodedPrompt, SamplingParams
from vlmreg.sdk.errors import VlmregError

MOVES = {"left": 0, "right": 1, "up": 2, "down": 3}


class GridWalk:
    """A gymnasium-API game in numpy: walk on an 8x8 grid to the goal. Frames are 64x64 RGB (agent red, goal green)."""

    def __init__(self, render_mode="rgb_array", limit=30):
        self.render_mode, self.limit = render_mode, limit

    def reset(self, seed=None, options=None):
        rng = np.random.default_rng(seed)
        self.agent = [int(rng.integers(0, 4)), int(rng.integers(0, 8))]
        self.goal = [7, int(self.agent[1])]
        self.t = 0
        return self.render(), {}

    def step(self, action):
        dx, dy = [(-1, 0), (1, 0), (0, -1), (0, 1)][action]
        self.agent = [min(7, max(0, self.agent[0] + dx)), min(7, max(0, self.agent[1] + dy))]
        self.t += 1
        reached = self.agent == self.goal
        return (
            self.render(),
            float(reached),
            reached,
            self.t >= self.limit,
            {"achievements": {"reach_goal": int(reached)}},
        )

    def render(self):
        frame = np.full((64, 64, 3), 200, dtype=np.uint8)
        for (x, y), colour in ((self.goal, (0, 200, 0)), (self.agent, (220, 0, 0))):
            frame[y * 8 : y * 8 + 8, x * 8 : x * 8 + 8] = colour
        return frame


SPEC = gym_environment(
    "gridwalk", GridWalk, actions=MOVES, prompt="Walk to the green square. Move: left, right, up or down.", max_steps=12
)


class Says:
    def __init__(self, *texts):
        self.texts, self.calls = texts, 0

    def chat(self, conversations, params, *, template_kwargs=None, names=None):
        text = self.texts[min(self.calls, len(self.texts) - 1)]
        self.calls += 1
        return [ChatTurn(EncodedPrompt([1], [], [], ""), Completion([2], [-1.0], "stop"), text) for _ in conversations]


def episodes(n):
    return [(Example(f"grid:{i}", [], answer=None), 0) for i in range(n)]


def test_a_game_plays_with_a_frame_each_turn_and_reports_length_return_and_achievements():
    store = ImageStore()
    trajectories = run_episodes(
        episodes(4),
        lambda e: SPEC.make(e, None, store),
        Says("Right!"),
        SamplingParams(),
        max_images_per_message=1,
        max_turns=20,
    )
    for t in trajectories:
        length = t.info["episode_length"]
        assert 4 <= length <= 7 and len(t.turns) == length  # from column 0-3 to column 7, one move a turn
        assert t.reward == t.info["episode_return"] == 1.0 and t.info["achievements"] == ["reach_goal"]
        assert t.info["invalid_actions"] == 0
    assert len(store) > 4  # new frames every turn


def test_an_answer_that_is_no_move_is_counted_and_the_episode_stops_at_max_steps():
    store = ImageStore()
    seen = []

    class Recording(Says):
        def chat(self, conversations, params, **kwargs):
            seen.extend(conversations)
            return super().chat(conversations, params, **kwargs)

    [t] = run_episodes(
        episodes(1),
        lambda e: SPEC.make(e, None, store),
        Recording("jump", "left"),
        SamplingParams(),
        max_images_per_message=1,
        max_turns=50,
    )
    assert t.info["invalid_actions"] == 1 and t.info["episode_length"] == 12 and t.reward == 0.0
    assert seen[1][-1] == {"role": "user", "content": "That is not a move. Moves: left, right, up, down."}


def test_the_tiny_model_plays_under_an_image_budget():
    """The tiny model on CPU (learning is not expected): every prompt holds at most K = 2 frames, one new each turn."""
    torch.manual_seed(0)
    loaded = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}})
    )
    store = ImageStore()
    engine = EmbeddedEngine(loaded.model, loaded.processor, store, torch.device("cpu"))
    spec = gym_environment("gridwalk", GridWalk, actions=lambda text: MOVES["right"], prompt="Move.", max_steps=5)
    trajectories = run_episodes(
        episodes(3),
        lambda e: spec.make(e, None, store),
        engine,
        SamplingParams(max_tokens=3),
        max_images_per_message=1,
        max_images_in_context=2,
        max_turns=5,
    )
    for t in trajectories:
        assert [len(turn.image_ids) for turn in t.turns] == [1] + [2] * (len(t.turns) - 1) and len(t.turns) >= 3
        assert t.images_over_budget == max(0, len(t.turns) - 2)


def test_a_game_served_over_http_plays_the_same():
    store = ImageStore()
    server = EnvServer(SPEC, None).start()
    try:
        remote = RemoteEnvironments(server.url, store, name="gridwalk", timeout_s=10)
        remote.verify(episodes(1)[0][0])
        far = run_episodes(
            episodes(3), remote.make, Says("right"), SamplingParams(), max_images_per_message=1, max_turns=20
        )
    finally:
        server.close()
    near = run_episodes(
        episodes(3),
        lambda e: SPEC.make(e, None, ImageStore()),
        Says("right"),
        SamplingParams(),
        max_images_per_message=1,
        max_turns=20,
    )
    assert [t.info for t in far] == [t.info for t in near] and [t.reward for t in far] == [1.0] * 3


def test_frames_must_be_rgb_uint8():
    assert frame_to_image(np.zeros((8, 8, 4), dtype=np.uint8), size=16).size == (16, 16)
    with pytest.raises(VlmregError, match=r"an \(H, W, 3\) uint8 RGB array; got shape \(8, 8\)"):
        frame_to_image(np.zeros((8, 8), dtype=np.uint8))
    with pytest.raises(VlmregError, match="render\\(\\) returned None"):
        GymEnvironment(
            type("G", (), {"reset": lambda self, seed=None: (None, {}), "render": lambda self: None})(),
            ImageStore(),
            actions=MOVES,
            prompt="go",
        ).reset(Example("x", [], answer=None))


def test_a_real_gymnasium_env_plays_through_its_wrappers():
    gymnasium = pytest.importorskip("gymnasium")
    # deferred: gymnasium is an optional extra
    from gymnasium import spaces  # noqa: PLC0415
    from gymnasium.wrappers import TimeLimit  # noqa: PLC0415

    class GymGridWalk(gymnasium.Env):
        metadata = {"render_modes": ["rgb_array"]}

        def __init__(self, render_mode="rgb_array"):
            self.game, self.render_mode = GridWalk(limit=10**6), render_mode
            self.observation_space = spaces.Box(0, 255, (64, 64, 3), np.uint8)
            self.action_space = spaces.Discrete(4)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return self.game.reset(seed=seed)

        def step(self, action):
            return self.game.step(int(action))

        def render(self):
            return self.game.render()

    spec = gym_environment(
        "gym-gridwalk",
        lambda: TimeLimit(GymGridWalk(), max_episode_steps=3),
        actions=MOVES,
        prompt="go",
        frame="observation",
    )
    [t] = run_episodes(
        episodes(1), lambda e: spec.make(e, None, ImageStore()), Says("up"), SamplingParams(), max_images_per_message=1
    )
    assert t.info["episode_length"] == 3 and len(t.turns) == 3  # truncated by gymnasium's TimeLimit
