"""The ``crafter`` task: Crafter worlds played from their frames through the gymnasium adapter. The episodes need the
optional ``crafter`` package (skipped without it); the task's registration and its error without it do not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import vlmreg
from vlmreg.cli import main
from vlmreg.config import parse_config
from vlmreg.data import ImageStore
from vlmreg.inference.embedded import EmbeddedEngine
from vlmreg.rewards import combine
from vlmreg.rollout.episodes import run_episodes
from vlmreg.sdk.engine import ChatTurn, Completion, EncodedPrompt, SamplingParams
from vlmreg.sdk.errors import VlmregError
from vlmreg.tasks import crafter


def test_crafter_is_registered_as_a_task_and_an_environment():
    task = vlmreg.get_task_registry().get("crafter")
    assert task.environment is vlmreg.get_environment_registry().get("crafter") and task.choices == crafter.ACTIONS
    examples = crafter.generate(3, 7, ImageStore())
    assert [e.id for e in examples] == ["crafter:0", "crafter:1", "crafter:2"]
    assert examples[1].metadata["seed"] == crafter.generate(2, 7, ImageStore())[1].metadata["seed"]


def test_without_the_package_an_episode_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "crafter", None)
    [example] = crafter.generate(1, 0, ImageStore())
    with pytest.raises(VlmregError, match="needs the crafter package: pip install crafter"):
        crafter.ENVIRONMENT.make(example, None, ImageStore())


def test_the_tiny_model_plays_crafter_episodes_with_a_frame_every_turn_under_an_image_budget():
    real = pytest.importorskip("crafter")
    assert tuple(real.constants.actions) == crafter.ACTIONS
    torch.manual_seed(0)
    loaded = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}})
    )
    store = ImageStore()
    engine = EmbeddedEngine(loaded.model, loaded.processor, store, torch.device("cpu"))
    examples = crafter.generate(3, 0, store)
    reward = combine(crafter.TASK.reward)
    spec = vlmreg.get_environment_registry().get("crafter")
    trajectories = run_episodes(
        [(e, 0) for e in examples],
        lambda e: spec.make(e, reward, store),
        engine,
        SamplingParams(max_tokens=4),
        max_images_per_message=1,
        max_images_in_context=2,
        max_turns=6,
    )
    for t in trajectories:
        # random answers: most are no action, still a turn each
        assert len(t.turns) == 6 and t.info["episode_length"] == 6
        assert all(len(turn.image_ids) <= 2 for turn in t.turns)
        assert {"episode_return", "invalid_actions"} <= set(t.info)


def test_a_frame_every_turn_and_at_most_k_in_context_over_a_long_episode():
    pytest.importorskip("crafter")

    seen = []

    class Walks:
        def chat(self, conversations, params, *, template_kwargs=None, names=None):
            seen.extend(conversations)
            return [
                ChatTurn(EncodedPrompt([1], [], [], ""), Completion([2], [-1.0], "stop"), "do") for _ in conversations
            ]

    store = ImageStore()
    [example] = crafter.generate(1, 3, store)
    [t] = run_episodes(
        [(example, 0)],
        lambda e: crafter.ENVIRONMENT.make(e, None, store),
        Walks(),
        SamplingParams(),
        max_images_per_message=1,
        max_images_in_context=2,
        max_turns=crafter.MAX_STEPS,
    )
    images = [
        sum(1 for m in c if not isinstance(m["content"], str) for p in m["content"] if p.get("type") == "image")
        for c in seen
    ]
    assert len(t.turns) == t.info["episode_length"] and images == [1] + [2] * (len(t.turns) - 1)
    assert t.images_over_budget == len(t.turns) - 2 and t.info["invalid_actions"] == 0


def test_train_runs_a_few_steps_on_crafter(tmp_path):
    """docs/environments.md's command, `vlmreg train examples/configs/crafter_tiny.toml`, on CPU for two steps (learning
    is not expected here)."""
    pytest.importorskip("crafter")

    config = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "crafter_tiny.toml")
    out = tmp_path / "run"
    argv = [
        "train",
        config,
        "--set",
        "logging.rollout_page_every=0",
        "--set",
        "trainer.steps=2",
        "--set",
        "trainer.prompts_per_step=2",
        "--set",
        "rollout.group_size=2",
        "--set",
        "rollout.max_turns=6",
        "--output-dir",
        str(out),
    ]
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and records[0]["images_dropped"] >= 0 and records[0]["samples"] > 0
    # per-episode game metrics: 6 turns at most, so each episode's length is in 1..6 and so is their mean
    for record in records:
        assert 1 <= record["env_episode_length"] <= 6 and "env_episode_return" in record
        assert record["images_over_budget"] <= record["images_dropped"]
