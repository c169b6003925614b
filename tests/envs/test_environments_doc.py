"""docs/environments.md's tutorial code runs: the plugin registers, episodes play in process and over HTTP alike."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

import vlmreg
from vlmreg.cli import main
from vlmreg.data import Example, ImageStore
from vlmreg.envs.remote import RemoteEnvironments
from vlmreg.envs.server import EnvServer
from vlmreg.rewards import combine
from vlmreg.rollout.episodes import run_episodes
from vlmreg.sdk.engine import ChatTurn, Completion, EncodedPrompt, SamplingParams

DOC = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()


class Says:
    def __init__(self, text):
        self.text = text

    def chat(self, conversations, params, *, template_kwargs=None, names=None):
        return [
            ChatTurn(EncodedPrompt([1], [], [], ""), Completion([2], [-1.0], "stop"), self.text) for _ in conversations
        ]


@pytest.fixture
def arrows(tmp_path, vlmreg_fresh_registry):
    code = next(block for block in re.findall(r"```python\n(.*?)```", DOC, re.S) if "class Arrows" in block)
    path = tmp_path / "arrows_game.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("arrows_game", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["arrows_game"] = module
    spec.loader.exec_module(module)
    vlmreg.register_plugin(module, name="arrows_game")
    yield module
    vlmreg.unregister_plugin("arrows_game")
    sys.modules.pop("arrows_game", None)


def test_the_tutorial_game_registers_and_plays_in_process_and_over_http(arrows, capsys):
    assert main(["env", "list", "--json"]) == 0
    assert "arrows" in {row["name"] for row in json.loads(capsys.readouterr().out)}
    spec = vlmreg.get_environment_registry().get("arrows")
    store = ImageStore()
    pairs = [(Example(f"arrows:{i}", [], answer=None), 0) for i in range(6)]
    reward = combine(spec.reward)
    near = run_episodes(
        pairs,
        lambda e: spec.make(e, reward, store),
        Says("left"),
        SamplingParams(),
        max_images_per_message=1,
        max_images_in_context=2,
    )
    assert all(len(t.turns) == arrows.TURNS and t.info == {"turns": 4} for t in near)
    assert 0 < sum(t.reward for t in near) < len(near)  # some arrows point left, some right
    assert all(t.images_over_budget == 2 for t in near)
    server = EnvServer(spec, reward).start()
    try:
        remote = RemoteEnvironments(server.url, store, name="arrows", timeout_s=10)
        remote.verify(pairs[0][0])
        far = run_episodes(
            pairs, remote.make, Says("left"), SamplingParams(), max_images_per_message=1, max_images_in_context=2
        )
    finally:
        server.close()
    assert [t.reward for t in far] == [t.reward for t in near]
