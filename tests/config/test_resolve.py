"""Config resolution (`vlmreg.config.resolve`): what it fills in from the family, and what it refuses, by message.

References: the family descriptors' own declarations (thinking modes, names) and the messages the docs promise.
"""

from __future__ import annotations

import types

import attrs
import pytest
import torch

import vlmreg
from vlmreg import Engine, Objective, hookimpl
from vlmreg.config import ConfigError, parse_config
from vlmreg.config.resolve import resolve_config

from .checkpoints import make_checkpoint


def config(family: str = "qwen3_vl", *, broadcast: dict | None = None, **rollout):
    document = {"model": {"init": "random", "family": family}, "trainer": {"device": "cpu"}, "rollout": rollout}
    return parse_config({**document, "broadcast": broadcast or {}})


def problems(cfg) -> str:
    with pytest.raises(ConfigError) as caught:
        resolve_config(cfg, source="run.toml")
    return str(caught.value)


def test_the_source_is_kept_and_names_the_file_in_errors():
    assert resolve_config(config(), source="run.toml").source == "run.toml"
    assert "run.toml" in problems(config(thinking_mode="sideways"))


def test_an_unknown_thinking_mode_names_the_random_init_and_what_is_available():
    family = vlmreg.get_family("qwen3_5")
    assert [m.name for m in family.thinking_modes_for(None)] == ["on", "off"]
    message = problems(config("qwen3_5", thinking_mode="sideways"))
    assert "rollout.thinking_mode: 'sideways' is not available for a random init of family qwen3_5" in message
    assert "(available: on, off)" in message


def test_a_thinking_budget_needs_a_model_with_thinking_modes_and_an_engine_that_applies_it():
    assert vlmreg.get_family("gemma3").thinking_modes_for(None) == ()
    assert "rollout.thinking_budget: set, but this model has no thinking modes" in problems(
        config("gemma3", thinking_budget=64)
    )
    # the OpenAI engine sends the budget to its server (vlmreg serve and vLLM apply it): accepted; an engine that does
    # not declare `thinking_budget` is refused (tests/inference/test_thinking_budget.py)
    rc = resolve_config(
        config(
            "qwen3_5",
            thinking_budget=64,
            engine="openai",
            server="vlmreg",
            url="http://127.0.0.1:8000",
            broadcast={"transport": "filesystem"},
        ),
        source="run.toml",
    )
    assert rc.config.rollout.thinking_budget == 64


def test_engine_vllm_gets_the_hint_that_vllm_is_a_server_and_other_names_do_not():
    assert "rollout.engine: " in problems(config(engine="mystery")) and "vLLM is a server" not in problems(
        config(engine="mystery")
    )


def test_a_checkpoint_s_family_is_filled_in_from_its_config(tmp_path):
    directory = make_checkpoint(tmp_path, "Qwen3-VL-2B-Instruct")
    rc = resolve_config(parse_config({"model": {"name": str(directory)}, "trainer": {"device": "cpu"}}))
    assert rc.config.model.family == "qwen3_vl" and rc.family.name == "qwen3_vl"
    assert rc.checkpoint_dir == directory


def test_a_loss_aggregation_for_an_objective_that_normalises_itself_is_refused_saying_how_to_fix_it(vlmreg_add_plugin):
    def own(x):
        return (x.logp * 0).sum(), torch.zeros_like(x.logp, dtype=torch.bool)

    vlmreg_add_plugin(
        types.SimpleNamespace(
            vlmreg_register_objectives=hookimpl(
                lambda register: register(
                    Objective(name="own_normaliser", loss=own, clip=(0.2, 0.2), description="normalises itself")
                )
            )
        ),
        "own-objective",
    )
    cfg = parse_config(
        {
            "model": {"init": "random", "family": "qwen3_vl"},
            "trainer": {"device": "cpu", "algorithm": "own_normaliser", "loss_aggregation": "token-mean"},
        }
    )
    assert " ".join(problems(cfg).split()).endswith(
        "trainer.loss_aggregation: objective 'own_normaliser' normalises its own loss (its Objective declares no "
        "aggregation), so 'token-mean' would do nothing: remove the key, or give the Objective an aggregation and "
        "reduce its terms with vlmreg.train.losses.aggregate"
    )


def test_problem_lines_are_whole_messages():
    """Each problem is its line exactly (the bad-config corpus matches parts of lines; these check the whole text,
    with the presets and modes each family declares)."""

    def lines(cfg) -> list[str]:
        with pytest.raises(ConfigError) as caught:
            resolve_config(cfg, source="run.toml")
        return caught.value.problems

    assert "rollout.image_only_mode: true needs images, but use_vision is false" in lines(
        config(use_vision=False, image_only_mode=True)
    )
    assert vlmreg.get_family("gemma3").thinking_modes_for(None) == ()
    assert "rollout.thinking_mode: 'on' is not available for a random init of family gemma3 (available: none)" in lines(
        config("gemma3", thinking_mode="on")
    )
    presets = ", ".join(vlmreg.get_family("qwen3_vl").lora_presets)
    lora = parse_config(
        {"model": {"init": "random", "family": "qwen3_vl", "lora": {"targets": "everything"}}, "trainer": {}}
    )
    (line,) = [p for p in lines(lora) if p.startswith("model.lora.targets")]
    assert line.endswith(f" Presets: {presets}; or give a list of module names")
    missing = parse_config(
        {"model": {"init": "random", "family": "qwen3_vl", "processor": "/nonexistent/processor"}, "trainer": {}}
    )
    (line,) = [p for p in lines(missing) if p.startswith("model.processor")]
    assert line.startswith("model.processor: ") and "/nonexistent/processor" in line


def test_a_familys_default_thinking_mode_is_taken_even_when_it_is_not_its_first(vlmreg_add_plugin, monkeypatch):
    """No bundled family's default is its first mode; a plugin family whose default is ``off`` (listed second) runs
    with ``off`` when the config names none."""
    monkeypatch.setenv("VLMREG_PLUGINS", "qwen3_5")
    qwen3_5 = vlmreg.get_family("qwen3_5")
    assert [m.name for m in qwen3_5.thinking_modes_for(None)] == ["on", "off"]

    class OffFirst:
        @hookimpl
        def vlmreg_register_families(self, register):
            register(attrs.evolve(qwen3_5, name="quiet_qwen", model_types=("quiet_qwen",), default_thinking_mode="off"))

    vlmreg_add_plugin(OffFirst(), "quiet")
    assert resolve_config(config("quiet_qwen"), source="run.toml").config.rollout.thinking_mode == "off"
    assert resolve_config(config("qwen3_5"), source="run.toml").config.rollout.thinking_mode == "on"


def test_vision_settings_at_their_limits_are_accepted_and_kept():
    """``use_vision``, ``image_only_mode`` and ``max_images_per_step`` equal to the family's declared
    ``max_images_per_message`` are valid; with ``use_vision = false`` no image is allowed a step (filled as 0)."""
    limit = vlmreg.get_family("qwen3_vl").max_images_per_message
    rollout = resolve_config(config(use_vision=True, image_only_mode=True, max_images_per_step=limit)).config.rollout
    assert (rollout.use_vision, rollout.image_only_mode, rollout.max_images_per_step) == (True, True, limit)
    rc = resolve_config(config(use_vision=False))
    assert (
        rc.config.rollout.max_images_per_step == 0
        and rc.from_family["rollout.max_images_per_step"] == "family qwen3_vl"
    )


def plugin_families(vlmreg_add_plugin, **families: dict) -> None:
    """Register families made from qwen3_5's descriptor with the given fields changed (name -> fields), and an engine
    ``plain0`` that runs in the trainer and declares that it cannot apply a thinking budget."""
    qwen3_5 = vlmreg.get_family("qwen3_5")
    made = [
        attrs.evolve(qwen3_5, name=name, model_types=(f"{name}_type",), **fields) for name, fields in families.items()
    ]

    class Families:
        @hookimpl
        def vlmreg_register_families(self, register):
            for family in made:
                register(family)

        @hookimpl
        def vlmreg_register_rollout_engines(self, register):
            register(Engine(name="plain0", build=lambda ctx: None, thinking_budget=False))

    vlmreg_add_plugin(Families(), "test-families")


def test_a_family_without_vision_refuses_use_vision_naming_itself(vlmreg_add_plugin):
    plugin_families(
        vlmreg_add_plugin, textonly={"supports_vision": False, "max_images_per_message": 0, "max_videos_per_message": 0}
    )
    assert vlmreg.get_family("textonly").supports_vision is False  # what the family declares
    assert problems(config("textonly", use_vision=True)).splitlines()[1:] == [
        "  rollout.use_vision: true, but family textonly has no vision support"
    ]


def test_a_familys_default_thinking_budget_is_filled_only_where_it_can_be_applied(vlmreg_add_plugin):
    """The default budget the family declares is filled when it has thinking modes, both thinking markers and an engine
    whose `Engine` declares ``thinking_budget``; a family that declares only the end marker, none of whose modes a
    random init has, or an engine that declares it cannot, gets none (and a budget set by hand is refused, each with
    its own line)."""
    on = next(m for m in vlmreg.get_family("qwen3_5").thinking_modes if m.name == "on")
    on_for_thinking_checkpoints = attrs.evolve(on, checkpoints=("*-Thinking*",))
    plugin_families(
        vlmreg_add_plugin,
        budgeted={"default_thinking_budget": 5},
        end_only={"default_thinking_budget": 5, "thinking_start": None},
        thinking_checkpoints={"default_thinking_budget": 5, "thinking_modes": (on_for_thinking_checkpoints,)},
    )
    assert vlmreg.get_family("thinking_checkpoints").thinking_modes_for(None) == ()  # none for a random init
    end_only = vlmreg.get_family("end_only")
    assert end_only.thinking_start is None and end_only.thinking_end and end_only.thinking_modes_for(None)
    assert vlmreg.get_engine_registry().get("embedded").thinking_budget is True
    rc = resolve_config(config("budgeted"))
    assert rc.config.rollout.thinking_budget == 5 and rc.from_family["rollout.thinking_budget"] == "family budgeted"
    assert rc.specs.engine is vlmreg.get_engine_registry().get("embedded")  # the parts the config names, looked up once
    assert resolve_config(config("budgeted", engine="plain0")).config.rollout.thinking_budget is None
    assert resolve_config(config("end_only")).config.rollout.thinking_budget is None
    assert resolve_config(config("thinking_checkpoints")).config.rollout.thinking_budget is None
    assert problems(config("end_only", thinking_budget=4)).splitlines()[1:] == [
        (
            "  rollout.thinking_budget: family end_only declares no thinking markers (thinking_start, thinking_end) "
            "to end the thinking with"
        )
    ]
    assert problems(config("budgeted", engine="plain0", thinking_budget=4)).splitlines()[1:] == [
        (
            "  rollout.thinking_budget: engine 'plain0' cannot end the thinking after a budget (its Engine declares "
            'thinking_budget = False); unset it, or use engine = "embedded" or "openai" (vLLM, vlmreg serve)'
        )
    ]


def test_lora_targets_default_to_the_familys_preset_and_a_regex_is_not_a_preset(vlmreg_add_plugin):
    """Without ``targets`` the family's default preset is checked against a frozen vision tower as if written;
    ``re:...`` is a pattern, not a preset name."""
    plugin_families(vlmreg_add_plugin, wide={"default_lora_preset": "all-linear"})
    assert vlmreg.get_family("wide").lora_presets["all-linear"].reaches_vision
    lora = {"model": {"init": "random", "family": "wide", "lora": {}}, "trainer": {}}
    with pytest.raises(ConfigError) as caught:
        resolve_config(parse_config(lora))
    assert caught.value.problems == [
        (
            "model.lora.targets: 'all-linear' adapts the vision encoder, but model.vlm.freeze_vision_encoder is "
            "true; set it to false, or pick targets that stay out of the vision tower"
        )
    ]
    pattern = {"model": {"init": "random", "family": "qwen3_vl", "lora": {"targets": "re:.*q_proj"}}, "trainer": {}}
    assert resolve_config(parse_config(pattern)).config.model.lora.targets == "re:.*q_proj"


def test_a_random_init_has_no_checkpoint_directory_and_takes_the_tiny_processor():
    rc = resolve_config(config())
    assert rc.checkpoint_dir is None and rc.processor.kind == "tiny" and rc.processor.directory is None
    assert rc.processor.note == "family qwen3_vl, its tiny processor (random init)"


def test_errors_name_the_source_and_default_to_config():
    with pytest.raises(ConfigError) as caught:
        resolve_config(config(thinking_mode="sideways"))
    assert caught.value.source == "<config>" and str(caught.value).startswith("<config>: 1 problem\n")
    missing = parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {}})
    with pytest.raises(ConfigError) as caught:
        resolve_config(attrs.evolve(missing, model=attrs.evolve(missing.model, family="no_such_family")), "run.toml")
    assert caught.value.source == "run.toml" and caught.value.problems[0].startswith("model.family: ")


def test_image_roots_are_checked_when_absolute_and_relative_ones_only_beside_a_config_file(tmp_path):
    """Relative ``data.image_roots`` entries of a config that is not a file are left to data loading; an absolute one
    that does not exist is named as written."""
    absent = str(tmp_path / "absent")
    document = {
        "model": {"init": "random", "family": "qwen3_vl"},
        "data": {"task": "colour", "image_roots": ["relative", absent]},
    }
    with pytest.raises(ConfigError) as caught:
        resolve_config(parse_config(document))
    assert caught.value.problems == [f"data.image_roots[1]: {absent!r} does not exist; list existing image folders"]


def test_a_random_init_of_a_family_without_a_tiny_processor_asks_for_model_processor(vlmreg_add_plugin):
    plugin_families(vlmreg_add_plugin, untiny={"tiny_processor": None})
    assert vlmreg.get_family("untiny").tiny_processor is None
    assert problems(config("untiny")).splitlines()[1:] == [
        (
            "  model.processor: family untiny has no tiny processor for a random init; set model.processor to a "
            "processor directory or Hub id"
        )
    ]
