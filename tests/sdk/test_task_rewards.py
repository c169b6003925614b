"""A task whose reward names no registered reward is never listed as usable (issue 11).

`vlmreg data tasks` used to list such a task. It still registers (a run's `[reward]` may replace its reward, and a
run that relies on it fails at validation, tests/tasks/test_tasks.py), but listing tasks is an error naming the task,
its plugin and the unknown reward.
"""

from __future__ import annotations

import types

import pytest

import vlmreg
from vlmreg import Task, VlmregError, hookimpl
from vlmreg.cli import main
from vlmreg.cli.data import task_records
from vlmreg.rewards import reward_names

REWARDS = ", ".join(reward_names())


def _generate(n, seed, store):  # never called: registration is what is tested
    return []


def task_plugin(name: str, reward: dict[str, float]) -> types.SimpleNamespace:
    plugin = types.SimpleNamespace()

    @hookimpl
    def vlmreg_register_tasks(register):
        register(Task(name=name, generate=_generate, reward=reward))

    plugin.vlmreg_register_tasks = vlmreg_register_tasks
    return plugin


@pytest.fixture
def in_process(vlmreg_add_plugin):
    return vlmreg_add_plugin


def test_an_unknown_reward_is_refused_on_listing_naming_task_plugin_and_reward(in_process):
    in_process(task_plugin("say_maybe", {"exact_mtch": 1.0}), "typo-tasks")
    assert "say_maybe" in vlmreg.get_task_registry()  # registered: a run's [reward] may replace it
    with pytest.raises(VlmregError) as info:
        task_records()
    assert str(info.value) == (
        "task 'say_maybe' from plugin 'typo-tasks' (registered in process) uses unknown reward 'exact_mtch'. "
        f"Did you mean 'exact_match'? Rewards: {REWARDS}"
    )


def test_every_unknown_reward_of_a_task_is_named(in_process):
    in_process(task_plugin("two_bad", {"format": 0.2, "frist_word": 1.0, "no_such_reward": 1.0}), "typo-tasks")
    with pytest.raises(VlmregError) as info:
        task_records()
    message = str(info.value)
    assert "task 'two_bad'" in message and "'format'" not in message.split("Rewards:")[0]
    assert "unknown reward 'frist_word'. Did you mean 'first_word'?" in message
    assert "unknown reward 'no_such_reward'. Rewards:" in message


def test_a_task_with_known_rewards_still_registers(in_process):
    in_process(task_plugin("say_yes", {"exact_match": 1.0, "format": 0.1}), "good-tasks")
    registry = vlmreg.get_task_registry()
    assert registry.get("say_yes").reward == {"exact_match": 1.0, "format": 0.1}
    assert registry.plugin_of("say_yes").name == "good-tasks"


TYPO_PLUGIN = """
from vlmreg import Task, hookimpl


def generate(n, seed, store):
    return []


@hookimpl
def vlmreg_register_tasks(register):
    register(Task(name="say_maybe", generate=generate, reward={"multiple_choise": 1.0}))
"""


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_vlmreg_data_tasks_fails_instead_of_listing_it(make_distribution, capsys, json_flag):
    module = make_distribution("typo-tasks", TYPO_PLUGIN)
    assert main(["data", "tasks", *json_flag]) == 1
    out, err = capsys.readouterr()
    assert out == ""  # nothing listed, not even the bundled tasks
    message = " ".join(err.split())
    assert f"distribution 'typo-tasks' (entry point 'typo_tasks = {module}')" in message
    assert "task 'say_maybe'" in message
    assert f"unknown reward 'multiple_choise'. Did you mean 'multiple_choice'? Rewards: {REWARDS}" in message
