"""A problem a ``--set KEY=VALUE`` override causes is reported against that ``--set``, not the config file."""

from __future__ import annotations

from pathlib import Path

import pytest

import vlmreg
from vlmreg.cli import main
from vlmreg.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml"


def train_error(capsys: pytest.CaptureFixture[str], config: Path, *sets: str, out: Path) -> str:
    args = [word for item in sets for word in ("--set", item)]
    assert main(["train", str(config), *args, "--output-dir", str(out)]) == 1
    assert not out.exists()  # refused before the output directory is made
    return capsys.readouterr().err


def test_a_set_typo_is_reported_against_the_set_not_the_file(tmp_path, capsys):
    err = train_error(capsys, MAIN, "trainer.stepz=3", out=tmp_path / "run")
    assert err.startswith("error: --set: 1 problem\n  --set trainer.stepz=3: unknown key. Did you mean 'steps'?"), err
    assert MAIN.name not in err


@pytest.mark.parametrize(
    ("item", "line"),
    [
        ("trainer.steps=-1", "--set trainer.steps=-1: must be > 0 (got -1)"),  # a value the schema refuses
        (
            'model.lora={r="x"}',
            '--set model.lora={r="x"}: model.lora.r: expected an integer',
        ),  # a key inside the value set
        # the family check
        ("model.family=qwen3vl", "--set model.family=qwen3vl: Unknown family 'qwen3vl'. Did you mean 'qwen3_vl'"),
        ("data.task=colours", "--set data.task=colours: Unknown task 'colours'. Did you mean 'colour'?"),
    ],
    ids=["value", "nested", "family", "task"],
)
def test_every_kind_of_set_problem_names_the_set(tmp_path, capsys, item, line):
    err = train_error(capsys, MAIN, item, out=tmp_path / "run")
    assert err.startswith("error: --set: 1 problem\n") and f"\n  {line}" in err, err


def test_the_file_keeps_its_own_problems_beside_a_set_problem(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(MAIN.read_text().replace("learning_rate = 3e-3", "learning_rate = 3e-3\nlearning_rat = 1"))
    err = train_error(capsys, config, "trainer.stepz=3", out=tmp_path / "run")
    assert err.startswith(f"error: {config}: 2 problems\n"), err
    assert "\n  trainer.learning_rat: unknown key. Did you mean 'learning_rate'?" in err  # the file's, as it was
    assert "\n  --set trainer.stepz=3: unknown key. Did you mean 'steps'?" in err


def test_the_later_set_of_a_key_is_the_one_named(tmp_path, capsys):
    err = train_error(capsys, MAIN, "trainer.steps=5", "trainer.steps=0", out=tmp_path / "run")
    assert "\n  --set trainer.steps=0: must be > 0 (got 0)" in err and "trainer.steps=5" not in err, err


def test_the_python_api_names_the_override(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(MAIN, ["trainer.stepz=3"])
    assert info.value.source == "--set" and info.value.problems[0].startswith("--set trainer.stepz=3: unknown key.")
    with pytest.raises(ConfigError, match=r"--set model\.family=qwen3vl: Unknown family"):
        vlmreg.train(MAIN, overrides=["model.family=qwen3vl"], output_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=r"--set trainer\.stepz=3: unknown key"):
        vlmreg.train(load_config(MAIN), overrides=["trainer.stepz=3"], output_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
