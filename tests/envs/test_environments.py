"""Environments: the registry, async environments, concurrent bounded calls with timeouts, errors that name the
environment, the call and the episode, and how a run picks its environment."""

from __future__ import annotations

import asyncio
import threading
import time
import types

import pytest

import vlmreg
from vlmreg import EnvironmentSpec, Task, hookimpl
from vlmreg.config import ConfigError, parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.data import ImageStore
from vlmreg.data.prompts import PromptEncoder
from vlmreg.envs.calls import first_messages
from vlmreg.envs.single_turn import SingleTurnEnvironment
from vlmreg.rollout.episodes import EnvironmentFailure, run_episodes
from vlmreg.sdk import UnknownEnvironmentError
from vlmreg.sdk.engine import ChatTurn, Completion, EncodedPrompt, SamplingParams
from vlmreg.sdk.environment import EnvStep
from vlmreg.sdk.errors import RegistryConflictError
from vlmreg.sdk.example import Example
from vlmreg.sdk.registry import get_task_registry
from vlmreg.tasks.colour_turns import ColourTurns
from vlmreg.train.source import load_run_data


class Echo:
    """A text engine: every conversation gets the completion "ok"."""

    def chat(self, conversations, params, *, template_kwargs=None, names=None):
        return [ChatTurn(EncodedPrompt([1], [], [], ""), Completion([2], [-1.0], "stop"), "ok") for _ in conversations]


def examples(n):
    return [(Example(f"game:{i}", [{"role": "user", "content": "hi"}], answer="ok"), i) for i in range(n)]


def play(make, n=1, **kwargs):
    return run_episodes(examples(n), make, Echo(), SamplingParams(), max_images_per_message=1, **kwargs)


# -- the registry ------------------------------------------------------------------------------------------------
def test_the_builtin_environments_are_registered_through_the_hook():
    registry = vlmreg.get_environment_registry()
    assert {"single_turn", "colour_turns"} <= set(registry.names())
    assert registry.plugin_of("colour_turns").name == "vlmreg.tasks"
    assert registry.get("colour_turns").make is ColourTurns
    assert vlmreg.get_task_registry().get("colour_turns").environment is registry.get("colour_turns")
    env = registry.get("single_turn").make(
        Example("x", [{"role": "user", "content": "q"}], answer="a"), lambda c, a: 1.0, ImageStore()
    )
    assert isinstance(env, SingleTurnEnvironment)


def test_an_unknown_environment_suggests_names():
    with pytest.raises(
        UnknownEnvironmentError, match=r"Unknown environment 'colour_turn'\. Did you mean 'colour_turns'\?"
    ):
        vlmreg.get_environment_registry().get("colour_turn")


@pytest.fixture
def game_plugin(vlmreg_fresh_registry):
    plugin = types.SimpleNamespace()

    @hookimpl
    def vlmreg_register_environments(register):
        register(
            EnvironmentSpec(
                name="guess", make=lambda example, reward, store: Guess(reward), reward={"exact_match": 1.0}
            )
        )

    plugin.vlmreg_register_environments = vlmreg_register_environments
    vlmreg.register_plugin(plugin, name="games")
    yield
    vlmreg.unregister_plugin("games")


class Guess:
    def __init__(self, reward):
        self.reward = reward

    def reset(self, example):
        self.answer = example.answer
        return list(example.messages)

    def step(self, completion):
        return EnvStep(reward=self.reward(completion, self.answer), done=True)


def test_a_plugin_environment_is_picked_by_rollout_environment(game_plugin):
    assert vlmreg.get_environment_registry().plugin_of("guess").name == "games"
    rc = resolve_config(
        parse_config(
            {
                "model": {"init": "random", "family": "qwen3_vl"},
                "data": {"task": "colour", "num_samples": 2},
                "rollout": {"environment": "guess"},
            }
        )
    )
    data = load_run_data(rc, ImageStore(), base_dir=".")
    assert data.environment == "guess" and isinstance(data.make_env(data.examples[0]), Guess)


def test_a_name_registered_twice_is_an_error(game_plugin):
    twice = types.SimpleNamespace()

    @hookimpl
    def vlmreg_register_environments(register):
        register(EnvironmentSpec(name="guess", make=lambda e, r, s: None))

    twice.vlmreg_register_environments = vlmreg_register_environments
    vlmreg.register_plugin(twice, name="games-again")
    try:
        with pytest.raises(RegistryConflictError, match="environment 'guess' is registered twice"):
            vlmreg.get_environment_registry()
    finally:
        vlmreg.unregister_plugin("games-again")


def test_a_task_s_environment_comes_from_the_registry_and_old_two_argument_factories_still_work():
    store = ImageStore()
    rc = resolve_config(
        parse_config(
            {"model": {"init": "random", "family": "qwen3_vl"}, "data": {"task": "colour_turns", "num_samples": 2}}
        )
    )
    data = load_run_data(rc, store, base_dir=".")
    assert data.environment == "colour_turns" and isinstance(data.make_env(data.examples[0]), ColourTurns)
    single = load_run_data(
        resolve_config(
            parse_config(
                {"model": {"init": "random", "family": "qwen3_vl"}, "data": {"task": "colour", "num_samples": 2}}
            )
        ),
        store,
        base_dir=".",
    )
    assert single.environment == "single_turn" and isinstance(
        single.make_env(single.examples[0]), SingleTurnEnvironment
    )


# -- calls: async, concurrent, bounded, timed ----------------------------------------------------------------------
class AsyncGame:
    live = 0
    most = 0
    lock = threading.Lock()

    def __init__(self, pause=0.2):
        self.pause, self.turn, self.closed = pause, 0, False

    async def reset(self, example):
        await self._hold()
        return list(example.messages)

    async def step(self, completion):
        await self._hold()
        self.turn += 1
        return EnvStep(reward=0.5, done=self.turn == 2, messages=[{"role": "user", "content": "again"}])

    async def _hold(self):
        with AsyncGame.lock:
            AsyncGame.live += 1
            AsyncGame.most = max(AsyncGame.most, AsyncGame.live)
        await asyncio.sleep(self.pause)
        with AsyncGame.lock:
            AsyncGame.live -= 1

    def close(self):
        self.closed = True


def test_async_environments_run_concurrently_within_the_bound_and_are_closed():
    AsyncGame.most = 0
    games = []

    def make(example):
        games.append(AsyncGame())
        return games[-1]

    started = time.perf_counter()
    trajectories = play(make, n=8, env_concurrency=4)
    elapsed = time.perf_counter() - started
    assert [t.reward for t in trajectories] == [1.0] * 8 and all(len(t.turns) == 2 for t in trajectories)
    assert AsyncGame.most == 4  # bounded by env_concurrency
    assert elapsed < 3 * 8 * 0.2 / 2  # 3 calls each, 8 episodes, 4 at a time: about 1.2 s, not the 4.8 s of one by one
    assert all(g.closed for g in games)


class SlowSync:
    def reset(self, example):
        return list(example.messages)

    def step(self, completion):
        time.sleep(3)
        return EnvStep(reward=0.0, done=True)


class SlowAsync:
    async def reset(self, example):
        await asyncio.sleep(3)
        return list(example.messages)


@pytest.mark.parametrize("make, call", [(SlowSync, "step"), (SlowAsync, "reset")])
def test_a_call_past_its_timeout_is_an_error_naming_the_environment_call_and_episode(make, call):
    started = time.perf_counter()
    with pytest.raises(
        EnvironmentFailure,
        match=rf"{make.__name__}\.{call} failed on game:0: no answer within 0.3 s \(rollout.env_timeout_s\)",
    ):
        play(lambda e: make(), env_timeout_s=0.3)
    assert time.perf_counter() - started < 2


class Broken:
    def __init__(self, where):
        self.where = where

    def reset(self, example):
        if self.where == "reset":
            raise KeyError("no such level")
        return list(example.messages)

    async def step(self, completion):
        if self.where == "step":
            raise ValueError("bad move")
        return EnvStep(reward=0.0, done=True)


@pytest.mark.parametrize(
    "where, message",
    [
        ("reset", "Broken.reset failed on game:1: KeyError: 'no such level'"),
        ("step", "Broken.step failed on game:1: ValueError: bad move"),
    ],
)
def test_a_failing_environment_names_itself_the_call_and_the_episode(where, message):
    made = iter([Broken("none"), Broken(where)])
    with pytest.raises(EnvironmentFailure, match=message.replace("(", r"\(")):
        play(lambda e: next(made), n=2)


def test_a_step_that_returns_the_wrong_type_is_named():
    class Lying:
        def reset(self, example):
            return list(example.messages)

        def step(self, completion):
            return {"reward": 1}

    with pytest.raises(EnvironmentFailure, match="Lying.step failed on game:0: returned dict, not an EnvStep"):
        play(lambda e: Lying())


def test_config_checks_the_environment_name_and_the_server_url():
    with pytest.raises(
        ConfigError, match=r"rollout.environment: Unknown environment 'colour_turn'\. Did you mean 'colour_turns'\?"
    ):
        resolve_config(
            parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "rollout": {"environment": "colour_turn"}})
        )
    with pytest.raises(ConfigError, match="rollout.max_images_in_context: must be >= 0"):
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "rollout": {"max_images_in_context": -1}})
    with pytest.raises(ConfigError, match="rollout.env_url: must start with http:// or https://"):
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "rollout": {"env_url": "ftp://x"}})


def test_every_environment_is_closed_even_when_one_close_fails_and_a_missing_method_is_named():
    closed = []

    class Closing:
        def __init__(self, n):
            self.n = n

        def reset(self, example):
            return list(example.messages)

        def step(self, completion):
            return EnvStep(reward=0.0, done=True)

        async def close(self):
            if self.n == 0:
                raise RuntimeError("already gone")
            closed.append(self.n)

    made = iter(range(4))
    play(lambda e: Closing(next(made)), n=4)
    assert sorted(closed) == [1, 2, 3]

    class NoStep:
        def reset(self, example):
            return list(example.messages)

    with pytest.raises(EnvironmentFailure, match="NoStep.step failed on game:0: AttributeError"):
        play(lambda e: NoStep())


def test_first_messages_awaits_an_async_reset_and_closes_the_environment():
    """The format warm-up and `vlmreg data preview` need only the prompt: an `async def reset` works there too."""

    class AsyncEnv:
        closed = False

        async def reset(self, example):
            return [{"role": "user", "content": f"hello {example.id}"}]

        def close(self):
            AsyncEnv.closed = True

    example = Example(id="demo:1", messages=[{"role": "user", "content": "x"}], answer="y")
    assert first_messages(AsyncEnv(), example, timeout_s=5) == [{"role": "user", "content": "hello demo:1"}]
    assert AsyncEnv.closed


# -- the system prompt, whichever environment is named ----------------------------------------------------------------
@pytest.fixture
def prompted_task(vlmreg_fresh_registry):
    """The bundled colour task again, with a system prompt of its own (the bundled tasks have none)."""

    colour = get_task_registry().get("colour")
    plugin = types.SimpleNamespace()

    @hookimpl
    def vlmreg_register_tasks(register):
        register(
            Task(
                name="prompted_colour",
                generate=colour.generate,
                reward=dict(colour.reward),
                system_prompt="Name the colour.",
            )
        )

    plugin.vlmreg_register_tasks = vlmreg_register_tasks
    vlmreg.register_plugin(plugin, name="prompted")
    yield
    vlmreg.unregister_plugin("prompted")


def prompt_ids(data, encoder):
    example = data.examples[0]
    return encoder.encode(first_messages(data.make_env(example), example, timeout_s=5)).input_ids


@pytest.mark.parametrize(
    ("task", "data_prompt", "expected"),
    [
        ("colour", "Answer in one word.", "Answer in one word."),  # [data] system_prompt
        ("prompted_colour", None, "Name the colour."),  # the task's own
    ],
)
def test_the_system_prompt_survives_naming_the_default_environment(prompted_task, task, data_prompt, expected):
    family = vlmreg.get_family("qwen3_vl")
    processor, store = family.tiny_processor(), ImageStore()
    encoder = PromptEncoder(processor, store, family)
    data_section = {"task": task, "num_samples": 2, **({"system_prompt": data_prompt} if data_prompt else {})}
    ids = {}
    for named in (None, "single_turn"):
        rollout = {"environment": named} if named else {}
        rc = resolve_config(
            parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "data": data_section, "rollout": rollout})
        )
        data = load_run_data(rc, store, base_dir=".")
        assert data.environment == "single_turn"
        ids[named] = prompt_ids(data, encoder)
    assert ids[None] == ids["single_turn"]
    # the reference: the processor's own rendering of the system prompt, found in the ids
    system = processor.tokenizer(
        processor.apply_chat_template([{"role": "system", "content": expected}], tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    assert any(ids["single_turn"][i : i + len(system)] == system for i in range(len(ids["single_turn"]))), (
        "no system prompt"
    )
