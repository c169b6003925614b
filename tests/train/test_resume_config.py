"""``--resume`` checks the config: the run keeps its resolved config; a change that makes it another run is refused
(naming each key, old -> new) unless ``--allow-config-change``; harmless changes are printed and accepted.

Real tiny CPU runs through the CLI and through `vlmreg.train`, as in test_run_safety.py.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

import vlmreg
from tests.train import test_run_safety
from tests.train.test_run_safety import FAST, MAIN, one_line_error, snapshot, steps_in_metrics, train
from vlmreg.cli import main
from vlmreg.config import load_config
from vlmreg.sdk.errors import VlmregError

no_model_loading = test_run_safety.no_model_loading  # a fixture, which the tests below take by name


def stored(out: Path) -> dict:
    return tomllib.loads((out / "config.toml").read_text())


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run (checkpoints at steps 1 and 2)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train(out, 2) == 0
    return out


@pytest.fixture
def run(finished: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def test_a_run_keeps_its_resolved_config_and_it_loads_back_as_a_config(finished):
    config = stored(finished)
    # what the example config and FAST say, and what the family filled in (the config names none of these)
    assert config["trainer"]["algorithm"] == "grpo" and config["rollout"]["group_size"] == 2
    assert config["trainer"]["steps"] == 2 and config["trainer"]["output_dir"] == str(finished)
    assert config["model"]["family"] == "qwen3_vl" and config["rollout"]["use_vision"] is True
    assert config["rollout"]["max_images_per_step"] >= 1
    loaded = load_config(finished / "config.toml")  # a config vlmreg itself reads, strictly
    assert loaded.trainer.learning_rate == 3e-3 and loaded.data.task == "colour"


@pytest.mark.parametrize(
    ("setting", "key", "change"),
    [
        ("trainer.algorithm=gspo", "trainer.algorithm", '"grpo" -> "gspo"'),
        ("rollout.group_size=4", "rollout.group_size", "2 -> 4"),
        ("model.seed=7", "model.seed", "0 -> 7"),
        ("data.seed=3", "data.seed", "0 -> 3"),
    ],
)
def test_a_change_that_makes_another_run_is_refused_before_the_model_loads(
    run, capsys, no_model_loading, setting, key, change
):
    before = snapshot(run)
    assert train(run, 3, "--resume", "--set", setting) == 1
    err = one_line_error(capsys)
    assert f"--resume: the config changes what defines the run in {run}" in err
    assert f"{key}: {change}" in err and "--allow-config-change" in err
    assert "trainer.steps" not in err  # a harmless change is not a reason
    assert snapshot(run) == before  # config.toml included


def test_harmless_changes_are_printed_and_accepted(run, capsys):
    assert (
        train(
            run,
            3,
            "--resume",
            "--set",
            "trainer.learning_rate=0.001",
            "--set",
            "eval.every=5",
            "--set",
            "model.attn_implementation=sdpa",
        )
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    assert "--resume: config changed: trainer.steps: 2 -> 3" in out
    assert "--resume: config changed: trainer.learning_rate: 0.003 -> 0.001" in out
    assert "--resume: config changed: eval.every: 0 -> 5" in out
    assert 'model.attn_implementation: "varlen" -> "sdpa"' in out
    assert steps_in_metrics(run) == [1, 2, 3]
    config = stored(run)  # the run now keeps the new config
    assert config["trainer"]["steps"] == 3 and config["trainer"]["learning_rate"] == 0.001


def test_an_unchanged_resume_prints_no_change(run, capsys):
    assert train(run, 2, "--resume") == 0
    assert "config changed" not in capsys.readouterr().out


def test_allow_config_change_continues_with_the_new_objective(run, capsys):
    assert train(run, 3, "--resume", "--allow-config-change", "--set", "trainer.algorithm=gspo") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        '--resume: config changed: trainer.algorithm: "grpo" -> "gspo" (changes the run; allowed by '
        "--allow-config-change)" in out
    )
    assert steps_in_metrics(run) == [1, 2, 3] and stored(run)["trainer"]["algorithm"] == "gspo"
    assert train(run, 3, "--resume") == 1  # the run is now a gspo run: going back is a change too
    assert 'trainer.algorithm: "gspo" -> "grpo"' in one_line_error(capsys)


def test_the_python_api_refuses_and_allows_the_same(run):
    sets = [*FAST[1::2], "trainer.steps=3", "trainer.algorithm=gspo"]
    with pytest.raises(VlmregError, match=r'trainer\.algorithm: "grpo" -> "gspo"'):
        vlmreg.train(MAIN, overrides=sets, output_dir=run, resume=True, log=lambda message: None)
    logged: list[str] = []
    result = vlmreg.train(
        MAIN, overrides=sets, output_dir=run, resume=True, allow_config_change=True, log=logged.append
    )
    assert result.step == 3 and any("trainer.algorithm" in line for line in logged)


def test_a_run_without_a_kept_config_resumes_with_a_note_and_keeps_one_from_then_on(run, capsys):
    (run / "config.toml").unlink()  # a run from before vlmreg kept its config
    assert train(run, 3, "--resume", "--set", "trainer.algorithm=gspo") == 0
    assert f"note: {run / 'config.toml'} is missing" in " ".join(capsys.readouterr().out.split())
    assert stored(run)["trainer"]["algorithm"] == "gspo"


def test_a_damaged_kept_config_is_an_error_naming_it(run, capsys):
    (run / "config.toml").write_text("[trainer\n")
    assert train(run, 3, "--resume") == 1
    assert f"--resume: {run / 'config.toml'} (the run's config) cannot be read" in one_line_error(capsys)


def test_allow_config_change_without_resume_is_refused(tmp_path, capsys):
    assert main(["train", MAIN, *FAST, "--output-dir", str(tmp_path / "run"), "--allow-config-change"]) == 1
    assert "--allow-config-change is for --resume" in one_line_error(capsys)
