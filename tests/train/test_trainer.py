"""`vlmreg train` end to end on CPU: it learns, writes its outputs, resumes exactly, and fails cleanly."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vlmreg
from vlmreg import Task, hookimpl
from vlmreg.cli import main
from vlmreg.sdk.environment import EnvStep
from vlmreg.tasks import colour

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml")
TIMING = {"tokens_per_s", "rollout_s", "update_s", "step_s"}
QUICK = ["--set", "trainer.format_warmup_steps=0", "--set", "eval.every=0", "--set", "logging.rollout_page_every=0"]


def metrics(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line]


def test_the_main_job_learns_the_colour_task(tmp_path):
    """A shorter version of the README's main job: format warm-up, then RL; the reward must rise well above chance."""
    out = tmp_path / "run"
    assert main(["train", MAIN, "--set", "trainer.steps=80", "--set", "eval.every=40", "--output-dir", str(out)]) == 0
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, 81))
    first = sum(r["reward_mean"] for r in records[:10]) / 10
    last = sum(r["reward_mean"] for r in records[-10:]) / 10
    assert first < 0.5 and last >= 0.7 and last > first + 0.3, (first, last)
    assert records[-1]["eval_reward_mean"] >= 0.7
    required = {
        "step",
        "reward_mean",
        "reward_std",
        "response_length",
        "entropy",
        "clip_fraction",
        "mismatch_kl",
        "tis_weight_mean",
        "tis_weight_max",
        "images_dropped",
        "tokens_per_s",
    }
    assert required <= set(records[0])
    pages = sorted((out / "rollouts").glob("step_*.html"))
    assert pages and "data:image/png;base64," in pages[-1].read_text()
    assert (out / "checkpoints" / "latest").read_text() == "step_000080"


def test_resume_gives_the_same_metrics_as_an_uninterrupted_run(tmp_path):
    common = [
        *QUICK,
        "--set",
        "trainer.prompts_per_step=4",
        "--set",
        "rollout.group_size=4",
        "--set",
        "trainer.save_every=3",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", MAIN, *common, "--set", "trainer.steps=6", "--output-dir", str(straight)]) == 0
    assert main(["train", MAIN, *common, "--set", "trainer.steps=3", "--output-dir", str(resumed)]) == 0
    assert main(["train", MAIN, *common, "--set", "trainer.steps=6", "--output-dir", str(resumed), "--resume"]) == 0
    a = [{k: v for k, v in r.items() if k not in TIMING} for r in metrics(straight)]
    b = [{k: v for k, v in r.items() if k not in TIMING} for r in metrics(resumed)]
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert a == b
    # the logged metrics can agree while the state does not (an optimizer left empty on resume, say): compare every
    # tensor of the two runs' final checkpoints, optimizer moments and step counts included
    for file in ("trainable.safetensors", "optimizer.safetensors"):
        x, y = (load_file(run / "checkpoints" / "step_000006" / file) for run in (straight, resumed))
        assert sorted(x) == sorted(y) and x
        assert [k for k in x if not torch.equal(x[k], y[k])] == [], file


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["train", MAIN, *QUICK, "--output-dir", str(tmp_path / "none"), "--resume"]) == 1
    assert "--resume: no checkpoint in" in capsys.readouterr().err


class CrashingGame:
    """Fails on its third call: the run must stop with the example named and its checkpoints intact."""

    calls = 0

    def __init__(self, example, reward):
        self.example = example

    def reset(self, example):
        return list(example.messages)

    def step(self, completion):
        CrashingGame.calls += 1
        if CrashingGame.calls > 2 * 16:  # two steps of 4 prompts x 4 completions
            raise ConnectionError("the game server went away")
        return EnvStep(reward=0.0, done=True)


@pytest.fixture
def crashing_task(vlmreg_fresh_registry):
    plugin = types.SimpleNamespace()

    @hookimpl
    def vlmreg_register_tasks(register):
        register(Task(name="crashing", generate=colour.generate, reward={"first_word": 1.0}, environment=CrashingGame))

    plugin.vlmreg_register_tasks = vlmreg_register_tasks
    CrashingGame.calls = 0
    vlmreg.register_plugin(plugin, name="crashing-tasks")
    yield
    vlmreg.unregister_plugin("crashing-tasks")


def test_a_crashing_environment_ends_the_run_with_a_clear_error_and_the_last_checkpoint_intact(
    tmp_path, capsys, crashing_task
):
    out = tmp_path / "run"
    argv = [
        "train",
        MAIN,
        *QUICK,
        "--set",
        "data.task=crashing",
        "--set",
        "trainer.prompts_per_step=4",
        "--set",
        "rollout.group_size=4",
        "--set",
        "trainer.save_every=1",
        "--set",
        "trainer.steps=5",
        "--output-dir",
        str(out),
    ]
    assert main(argv) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "CrashingGame.step failed on colour:" in err
        and "ConnectionError: the game server went away" in err
        and "Traceback" not in err
    )
    assert (out / "checkpoints" / "latest").read_text() == "step_000002"
    assert main(["eval", MAIN, "--checkpoint", str(out), "--json", "--set", "eval.num_samples=4"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"].endswith("step_000002")


@pytest.mark.parametrize(
    "extra",
    [
        ["--set", "trainer.algorithm=gspo"],
        ["--set", "trainer.kl_coef=0.1"],
        ["--set", "trainer.kl_coef=0.1", "--set", "model.lora.r=4"],
        ["--set", "trainer.packing=false", "--set", "trainer.tis=false"],
        ["--set", "data.task=colour_turns"],
    ],
    ids=["gspo", "kl-full", "kl-lora", "padded-no-tis", "multi-turn"],
)
def test_variants_run(tmp_path, extra):
    out = tmp_path / "run"
    argv = [
        "train",
        MAIN,
        *QUICK,
        "--set",
        "trainer.steps=2",
        "--set",
        "trainer.prompts_per_step=2",
        "--set",
        "rollout.group_size=4",
        *extra,
        "--output-dir",
        str(out),
    ]
    assert main(argv) == 0
    records = metrics(out)
    assert len(records) == 2 and all(0.0 <= r["reward_mean"] <= 1.0 for r in records)
    if "trainer.kl_coef=0.1" in extra:
        assert "kl_ref" in records[0]
    if "data.task=colour_turns" in extra:
        assert records[0]["turns_merged"] + records[0]["prefix_breaks"] == 2 * 4 * 2  # 3 turns: 2 joins per episode


def test_a_seq_len_that_drops_every_sample_is_an_error_not_a_silent_success(tmp_path, capsys):
    """seq_len = 8 leaves no generated token in any sample: exit 1 naming the key, no step trained (issue 11)."""
    out = tmp_path / "run"
    assert (
        main(
            ["train", MAIN, *QUICK, "--set", "trainer.steps=2", "--set", "trainer.seq_len=8", "--output-dir", str(out)]
        )
        == 1
    )
    err = " ".join(capsys.readouterr().err.split())
    assert "step 1: all" in err and "trainer.seq_len = 8" in err and "Traceback" not in err
    assert not (out / "metrics.jsonl").exists() or metrics(out) == []
