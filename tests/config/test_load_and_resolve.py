"""Loading TOML strictly, --set overrides, descriptor injection with provenance, and contradictions."""

from __future__ import annotations

import tomllib

import pytest

import vlmreg
from vlmreg.config import ConfigError, RunConfig, load_config, parse_config
from vlmreg.config.resolve import find_checkpoint, resolve_config
from vlmreg.config.toml_out import to_toml
from vlmreg.sdk.errors import VlmregError

TINY = {"model": {"init": "random", "family": "qwen3_vl"}}


def test_defaults_are_filled_for_a_minimal_config():
    config = parse_config(TINY)
    assert isinstance(config, RunConfig)
    assert config.model.vlm.freeze_vision_encoder and config.model.lora is None
    assert config.rollout.group_size == 8 and config.trainer.algorithm == "grpo" and config.data.task == "colour"


def test_set_overrides_parse_toml_values(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\ninit = "random"\nfamily = "qwen3_vl"\n')
    config = load_config(
        path, ["model.lora.r=8", "rollout.temperature=0.7", "trainer.algorithm=gspo", 'model.lora.targets=["q_proj"]']
    )
    assert config.model.lora.r == 8 and config.model.lora.targets == ["q_proj"]
    assert config.rollout.temperature == 0.7 and config.trainer.algorithm == "gspo"
    with pytest.raises(ConfigError, match="--set 'oops': expected key.path=value"):
        load_config(path, ["oops"])
    with pytest.raises(ConfigError, match=r"--set model\.lora\.r=0: must be > 0"):  # reported against the --set
        load_config(path, ["model.lora.r=0"])


def test_unreadable_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="missing.toml: 1 problem\n  cannot read the file"):
        load_config(tmp_path / "missing.toml")


def test_integers_are_accepted_for_floats_but_not_the_reverse():
    config = parse_config({**TINY, "trainer": {"learning_rate": 1, "clip_high": 1}})
    assert config.trainer.learning_rate == 1.0 and isinstance(config.trainer.learning_rate, float)
    with pytest.raises(ConfigError, match="trainer.steps: expected an integer \\(got 10.0, a number\\)"):
        parse_config({**TINY, "trainer": {"steps": 10.0}})


def test_descriptor_values_are_injected_and_marked():
    rc = resolve_config(parse_config({**TINY, "model": {**TINY["model"], "lora": {"r": 4}}}))
    assert rc.family.name == "qwen3_vl"
    assert rc.config.rollout.use_vision is True and rc.config.rollout.max_images_per_step == 16
    assert rc.config.rollout.thinking_mode == "off" and rc.config.model.lora.targets == "language"
    assert rc.from_family == {
        "model.lora.targets": "family qwen3_vl",
        "rollout.use_vision": "family qwen3_vl",
        "rollout.max_images_per_step": "family qwen3_vl",
        "rollout.thinking_mode": "family qwen3_vl",
    }


def test_values_written_by_hand_are_kept_when_compatible():
    rc = resolve_config(parse_config({**TINY, "rollout": {"max_images_per_step": 2, "thinking_mode": "off"}}))
    assert rc.config.rollout.max_images_per_step == 2 and "rollout.max_images_per_step" not in rc.from_family
    assert "rollout.thinking_mode" not in rc.from_family


def test_thinking_defaults_follow_the_family():
    rc = resolve_config(parse_config({"model": {"init": "random", "family": "qwen3_5"}}))
    assert rc.config.rollout.thinking_mode == "on"
    rc = resolve_config(
        parse_config({"model": {"init": "random", "family": "qwen3_5"}, "rollout": {"thinking_mode": "off"}})
    )
    assert rc.config.rollout.thinking_mode == "off"


def test_vision_lora_is_fine_once_the_tower_is_unfrozen():
    rc = resolve_config(
        parse_config(
            {"model": {**TINY["model"], "lora": {"targets": "all-linear"}, "vlm": {"freeze_vision_encoder": False}}}
        )
    )
    assert rc.config.model.lora.targets == "all-linear"


def test_all_contradictions_are_reported_together():
    with pytest.raises(ConfigError) as info:
        resolve_config(
            parse_config(
                {
                    "model": {**TINY["model"], "lora": {"targets": "all-linear"}},
                    "rollout": {"max_images_per_step": 99, "thinking_mode": "think"},
                }
            )
        )
    assert len(info.value.problems) == 3


def test_resolved_toml_round_trips_and_marks_descriptor_values():
    rc = resolve_config(parse_config({**TINY, "model": {**TINY["model"], "lora": {"r": 4}}}))
    text = to_toml(rc.config, rc.from_family)
    assert 'targets = "language"  # from family qwen3_vl' in text
    assert "# name = (unset)" in text
    assert parse_config(tomllib.loads(text)) == rc.config


def _fake_hub_cache(root, repo_id: str, files: dict[str, str]):
    org, name = repo_id.split("/")
    snapshot = root / f"models--{org}--{name}" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for file, text in files.items():
        (snapshot / file).write_text(text)
    refs = root / f"models--{org}--{name}" / "refs"
    refs.mkdir()
    (refs / "main").write_text("abc123")
    return snapshot


def test_a_hub_id_is_found_in_the_local_cache_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshot = _fake_hub_cache(tmp_path, "acme/Toy-VL", {"config.json": '{"model_type": "qwen3_vl"}'})
    assert find_checkpoint("acme/Toy-VL") == snapshot
    with pytest.raises(
        VlmregError,
        match="'acme/Other' is not a local directory and not in the Hugging Face cache .*offline mode is on",
    ):
        find_checkpoint("acme/Other")


def test_a_checkpoint_of_another_family_contradicts_model_family(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5"}')
    with pytest.raises(
        ConfigError, match="model.family: 'qwen3_vl' claims qwen3_vl, but the checkpoint's model_type is 'qwen3_5'"
    ):
        resolve_config(parse_config({"model": {"name": str(tmp_path), "family": "qwen3_vl"}}))
    # a family that claims several model types lists them all (idefics3 declares idefics3 and smolvlm)
    claimed = ", ".join(vlmreg.get_family("idefics3").model_types)
    assert "," in claimed
    with pytest.raises(ConfigError) as caught:
        resolve_config(parse_config({"model": {"name": str(tmp_path), "family": "idefics3"}}))
    assert caught.value.problems == [
        (
            f"model.family: 'idefics3' claims {claimed}, but the checkpoint's model_type is 'qwen3_5' "
            "(family 'qwen3_5' if installed); drop model.family"
        )
    ]


def test_a_directory_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json; is it a transformers checkpoint directory"):
        resolve_config(parse_config({"model": {"name": str(tmp_path)}}))


def test_reward_functions_round_trip_as_an_inline_table():
    """A launched server gets the trainer's config as TOML: a [reward] functions mapping must survive it
    (the reference: Python's own TOML parser reads the text back to the same config)."""
    rc = resolve_config(
        parse_config({**TINY, "data": {"task": "colour"}, "reward": {"functions": {"first_word": 0.7, "format": 0.3}}})
    )
    text = to_toml(rc.config, rc.from_family)
    assert tomllib.loads(text)["reward"]["functions"] == {"first_word": 0.7, "format": 0.3}
    assert parse_config(tomllib.loads(text)) == rc.config


def test_toml_nested_too_deeply_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="(?s)deep.toml.*nested too deeply"):
        load_config(path)
    with pytest.raises(ConfigError, match="(?s)--set.*nested too deeply"):
        load_config(_tiny_config(tmp_path), sets=["trainer.steps=" + "[" * 5000 + "]" * 5000])


def _tiny_config(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text('[model]\ninit = "random"\nfamily = "qwen3_vl"\n')
    return path
