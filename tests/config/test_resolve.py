"""Config resolution (`vlmreg.config.resolve`): what it fills in from the family, and what it refuses, by message.

References: the family descriptors' own declarations (thinking modes, names) and the messages the docs promise.
"""

from __future__ import annotations

import types

import attrs
import pytest
import torch

import vlmreg
from vlmreg import Objective, hookimpl
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
