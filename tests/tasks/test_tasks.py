"""The bundled tasks (deterministic by seed, answers checked on the pixels) and tasks from third-party plugins."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import vlmreg
from vlmreg import RegistryConflictError, UnknownTaskError
from vlmreg.config.load import ConfigError
from vlmreg.config.resolve import resolve_config
from vlmreg.config.schema import DataSection, ModelSection, RewardSection, RunConfig
from vlmreg.data import ImageStore
from vlmreg.rewards import combine
from vlmreg.tasks import colour, count

TASKS_DOC = (Path(__file__).resolve().parents[2] / "docs" / "tasks.md").read_text()


def pixels(store: ImageStore, example) -> np.ndarray:
    (image_id,) = example.image_ids()
    return np.asarray(store.get(image_id), dtype=np.int64)


def connected_regions(mask: np.ndarray) -> int:
    """Count 8-connected regions of ``mask`` by propagating the smallest label until nothing changes."""
    big = mask.size + 1
    labels = np.where(mask, np.arange(mask.size).reshape(mask.shape), big)
    while True:
        padded = np.pad(labels, 1, constant_values=big)
        h, w = mask.shape
        neighbours = [padded[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w] for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
        new = np.where(mask, np.minimum.reduce(neighbours), big)
        if np.array_equal(new, labels):
            return len(np.unique(labels[mask]))
        labels = new


def test_connected_regions_helper():
    mask = np.zeros((6, 6), bool)
    mask[0, 0] = mask[1, 1] = True  # diagonal neighbours: one region
    mask[4:6, 3:6] = True
    assert connected_regions(mask) == 2


# -- registration ------------------------------------------------------------------------------


def test_the_bundled_tasks_come_from_the_builtin_plugin():
    registry = vlmreg.get_task_registry()
    assert {"colour", "count"} <= set(registry.names())
    for name in ("colour", "count"):
        plugin = registry.plugin_of(name)
        assert (plugin.name, plugin.distribution) == ("vlmreg.tasks", "vlmreg")


def test_an_unknown_task_gets_a_suggestion():
    with pytest.raises(UnknownTaskError, match=r"Unknown task 'color'\. Did you mean 'colour'\?"):
        vlmreg.get_task_registry().get("color")


@pytest.mark.parametrize("task", [colour.TASK, count.TASK], ids=["colour", "count"])
def test_task_fields(task):
    assert vlmreg.get_task_registry().get(task.name) is task
    assert task.description
    combine(task.reward)  # every reward name exists


# -- determinism ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["colour", "count"])
def test_same_seed_same_data_other_seed_other_data(name):
    task = vlmreg.get_task_registry().get(name)
    a, b, c = ImageStore(), ImageStore(), ImageStore()
    first, again, other = task.generate(12, 7, a), task.generate(12, 7, b), task.generate(12, 8, c)
    assert [e.image_ids() for e in first] == [e.image_ids() for e in again]  # ids are content hashes
    assert [e.answer for e in first] == [e.answer for e in again]
    assert [e.messages for e in first] == [e.messages for e in again]
    assert not {e.image_ids()[0] for e in first} & {e.image_ids()[0] for e in other}
    assert [e.image_ids() for e in task.generate(5, 7, ImageStore())] == [e.image_ids() for e in first[:5]]
    assert [e.id for e in first] == [f"{name}:{i}" for i in range(12)]
    assert {e.task for e in first} == {name}
    assert all(e.metadata["seed"] == 7 for e in first)
    assert len(a) == len({e.image_ids()[0] for e in first})


# -- colour -----------------------------------------------------------------------------------------


def test_colour_prompt_is_the_same_for_every_sample_and_names_the_choices():
    store = ImageStore()
    examples = colour.generate(30, 0, store)
    texts = {part["text"] for e in examples for part in e.messages[0]["content"] if part["type"] == "text"}
    assert texts == {"What colour is the shape? Red, Green or Blue?"}
    assert [part["type"] for part in examples[0].messages[0]["content"]] == ["image", "text"]
    assert {e.answer for e in examples} == {"Red", "Green", "Blue"}
    assert all(store.get(e.image_ids()[0]).size == (64, 64) for e in examples)


def test_colour_answer_is_the_dominant_colour_of_the_pixels():
    store = ImageStore()
    examples = colour.generate(300, 3, store)
    counts = {answer: 0 for answer in colour.COLOURS}
    for example in examples:
        rgb = pixels(store, example)
        channel = colour.COLOURS[example.answer]
        assert int(np.argmax(rgb.reshape(-1, 3).mean(0))) == channel, example.id
        saturated = rgb.max(-1) - rgb.min(-1) > 60  # the background is grey, r = g = b
        assert saturated.mean() >= 0.45, example.id  # the shape dominates the image
        assert (np.argmax(rgb[saturated], -1) == channel).all(), example.id
        counts[example.answer] += 1
    assert min(counts.values()) > 60  # all three colours are common: chance is 1/3


@pytest.fixture(scope="module")
def tiny_processor():
    return vlmreg.get_family("qwen3_vl").tiny_processor()


def test_colour_answers_are_single_tokens_of_the_tiny_tokenizer_and_appear_in_the_prompt(tiny_processor):
    tokenizer = tiny_processor.tokenizer
    answers = {answer: tokenizer.encode(answer, add_special_tokens=False) for answer in colour.COLOURS}
    assert answers == {"Red": [738], "Green": [745], "Blue": [802]}
    assert [len(tokenizer.encode(w, add_special_tokens=False)) for w in ("red", "green", "blue")] == [2, 2, 3]
    store = ImageStore()
    (example,) = colour.generate(1, 0, store)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": colour.PROMPT}]}]
    prompt = tiny_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    inputs = tiny_processor(text=[prompt], images=[store.get(example.image_ids()[0])], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 4  # 64x64: patch 16, merge 2
    assert all(token in ids for (token,) in answers.values())
    assert tokenizer.encode("Red<|im_end|>", add_special_tokens=False) == [
        738,
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    assert len(ids) < 40


def test_colour_reward_scores_the_first_word():
    reward = combine(colour.TASK.reward)
    assert reward("Red", "Red") == 1.0
    assert reward("red.", "Red") == 1.0
    assert reward("Blue", "Red") == 0.0
    assert colour.TASK.choices == ("Red", "Green", "Blue")
    assert [reward(choice, "Green") for choice in colour.TASK.choices] == [0.0, 1.0, 0.0]


# -- count --------------------------------------------------------------------------------------


def test_count_answer_is_the_number_of_separate_shapes():
    store = ImageStore()
    examples = count.generate(120, 5, store)
    for example in examples:
        rgb = pixels(store, example)
        assert rgb.shape == (128, 128, 3)
        shape_pixels = (rgb != 255).any(-1)
        assert connected_regions(shape_pixels) == example.answer == len(example.metadata["shapes"]), example.id
    assert {e.answer for e in examples} == set(range(1, 7))
    assert all(isinstance(e.answer, int) for e in examples)


def test_count_prompt_and_reward():
    (example,) = count.generate(1, 0, ImageStore())
    assert example.messages[0]["content"][1]["text"] == "How many shapes are there? Put the number in \\boxed{}."
    reward = combine(count.TASK.reward)
    assert reward(f"There are \\boxed{{{example.answer}}} shapes.", example.answer) == 1.0
    assert reward(f"\\boxed{{{example.answer + 1}}}", example.answer) == 0.0
    assert reward(str(example.answer), example.answer) == 0.0
    assert count.TASK.choices == tuple(f"\\boxed{{{n}}}" for n in range(1, 7))
    assert [reward(choice, 3) for choice in count.TASK.choices] == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert all(combine({"format": 1.0})(choice, None) == 1.0 for choice in count.TASK.choices)


# -- third-party tasks --------------------------------------------------------------------------

TASK_PLUGIN = """
from vlmreg import Task, hookimpl


def generate(n, seed, store):
    from PIL import Image
    from vlmreg.data import Example, image_part, text_part

    out = []
    for index in range(n):
        image_id = store.add(Image.new("RGB", (32, 32), (seed % 256, index % 256, 0)))
        content = [image_part(image_id), text_part("Say yes.")]
        out.append(Example(f"{name}:{{index}}", [{{"role": "user", "content": content}}], "yes", task={name!r}))
    return out


@hookimpl
def vlmreg_register_tasks(register):
    register(Task(name={name!r}, generate=generate, reward={reward!r}))
"""


def task_plugin(name: str, reward: dict[str, float] | None = None) -> str:
    return TASK_PLUGIN.format(name=name, reward=reward or {"exact_match": 1.0})


def test_a_third_party_task_registers_through_a_real_entry_point(make_distribution):
    module = make_distribution("acme-tasks", task_plugin("say_yes"), version="0.3")
    registry = vlmreg.get_task_registry()
    task = registry.get("say_yes")
    plugin = registry.plugin_of("say_yes")
    assert (plugin.distribution, plugin.version, plugin.entry_point) == ("acme-tasks", "0.3", f"acme_tasks = {module}")
    examples = task.generate(3, 1, ImageStore())
    assert [e.id for e in examples] == ["say_yes:0", "say_yes:1", "say_yes:2"]
    assert combine(task.reward)("Yes!", examples[0].answer) == 1.0
    assert {"colour", "count"} <= set(registry.names())  # the bundled ones are still there


def test_a_task_name_registered_by_two_distributions_names_both(make_distribution):
    make_distribution("first-tasks", task_plugin("shared"))
    make_distribution("second-tasks", task_plugin("shared"))
    with pytest.raises(RegistryConflictError, match="task 'shared' is registered twice") as info:
        vlmreg.get_task_registry()
    assert "distribution 'first-tasks'" in str(info.value) and "distribution 'second-tasks'" in str(info.value)


def test_a_bundled_task_name_cannot_be_taken_over(make_distribution):
    make_distribution("impostor-tasks", task_plugin("colour"))
    with pytest.raises(RegistryConflictError) as info:
        vlmreg.get_task_registry()
    assert "distribution 'vlmreg'" in str(info.value) and "distribution 'impostor-tasks'" in str(info.value)


def test_the_plugin_example_in_docs_tasks_md_works(make_distribution):
    code = next(
        block for block in re.findall(r"```python\n(.*?)```", TASKS_DOC, re.DOTALL) if "vlmreg_register_tasks" in block
    )
    make_distribution("size-task", code)
    task = vlmreg.get_task_registry().get("size")
    store = ImageStore()
    examples = task.generate(4, 0, store)
    assert [e.answer for e in examples] == ["small", "large", "small", "large"]
    assert [store.get(e.image_ids()[0]).size for e in examples][:2] == [(32, 32), (64, 64)]


def test_the_usage_example_in_docs_tasks_md_runs():
    code = next(
        block for block in re.findall(r"```python\n(.*?)```", TASKS_DOC, re.DOTALL) if "combine(task.reward)" in block
    )
    namespace: dict = {}
    exec(code, namespace)
    assert len(namespace["examples"]) == 8 and namespace["reward"]("Red", "Red") == 1.0


# -- config checks ---------------------------------------------------------------------------------


def config(task: str | None = "colour", functions: dict[str, float] | None = None) -> RunConfig:
    return RunConfig(
        model=ModelSection(init="random", family="qwen3_vl"),
        data=DataSection(task=task),
        reward=RewardSection(functions=functions),
    )


def test_a_config_naming_a_bundled_task_and_known_rewards_resolves():
    assert resolve_config(config("count", {"math": 1.0, "format": 0.1})).config.data.task == "count"
    assert resolve_config(config("colour")).family.name == "qwen3_vl"


def test_a_config_with_an_unknown_task_and_reward_lists_both():
    with pytest.raises(ConfigError) as info:
        resolve_config(config("colours", {"exact_mach": 1.0}))
    problems = info.value.problems
    assert any(p.startswith("data.task: Unknown task 'colours'. Did you mean 'colour'?") for p in problems)
    assert any(
        p.startswith("reward.functions: unknown reward 'exact_mach'. Did you mean 'exact_match'?") for p in problems
    )


def test_a_plugin_task_naming_an_unknown_reward_is_reported_on_data_task(make_distribution):
    make_distribution("sloppy-tasks", task_plugin("sloppy", {"exact_macth": 1.0}))
    with pytest.raises(ConfigError) as info:
        resolve_config(config("sloppy"))
    assert any(
        p.startswith(
            "data.task: the reward of task 'sloppy': unknown reward 'exact_macth'. Did you mean 'exact_match'?"
        )
        for p in info.value.problems
    ), info.value.problems
    assert resolve_config(config("sloppy", {"exact_match": 1.0})).config.data.task == "sloppy"  # [reward] replaces it
