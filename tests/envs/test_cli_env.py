"""`vlmreg env serve` and `vlmreg train` against it, as separate processes on 127.0.0.1 (docs/environments.md)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlmreg.cli import main

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml")
QUICK = ["--set", "trainer.format_warmup_steps=0", "--set", "eval.every=0", "--set", "logging.rollout_page_every=0"]
KEY = "env-test-key-1234"


def vlmreg_cmd(*args):
    return [sys.executable, "-m", "vlmreg", *args]


@pytest.fixture
def env_server():
    """`vlmreg env serve colour_turns --port 0`, with an API key; yields its URL."""
    env = {**os.environ, "VLMREG_ENV_API_KEY": KEY}
    process = subprocess.Popen(
        vlmreg_cmd("env", "serve", "colour_turns", "--port", "0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = process.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        assert match, (line, process.poll())
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_env_list_shows_the_registered_environments(capsys):
    assert main(["env", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["colour_turns"]["reward"] == {"first_word": 1.0} and rows["colour_turns"]["plugin"] == "vlmreg.tasks"
    assert "single_turn" in rows


TIMING = {"tokens_per_s", "rollout_s", "update_s", "step_s"}


def test_train_against_a_served_environment_trains_exactly_as_in_process(env_server, tmp_path):
    """The same run, its environment in another process or in the trainer's: the same metrics, step for step."""
    common = [
        *QUICK,
        "--set",
        "data.task=colour_turns",
        "--set",
        "trainer.steps=3",
        "--set",
        "trainer.prompts_per_step=2",
        "--set",
        "rollout.group_size=4",
        "--set",
        "rollout.max_images_in_context=2",
    ]
    env = {**os.environ, "VLMREG_ENV_API_KEY": KEY}
    remote, local = tmp_path / "remote", tmp_path / "local"
    argv = vlmreg_cmd("train", MAIN, *common, "--set", f"rollout.env_url={env_server}", "--output-dir", str(remote))
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert main(["train", MAIN, *common, "--output-dir", str(local)]) == 0
    far, near = (
        [
            {k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (d / "metrics.jsonl").read_text().splitlines()
        ]
        for d in (remote, local)
    )
    assert len(far) == 3 and far == near
    assert far[0]["images_dropped"] == 2 * 4 * 1  # 3 images, 2 kept: one replaced per episode
    assert far[0]["response_length"] > 0


def test_train_refuses_a_server_without_the_key_before_training(env_server, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("VLMREG_ENV_API_KEY", raising=False)
    out = tmp_path / "run"
    code = main(
        [
            "train",
            MAIN,
            *QUICK,
            "--set",
            "data.task=colour_turns",
            "--set",
            f"rollout.env_url={env_server}",
            "--set",
            "trainer.steps=1",
            "--output-dir",
            str(out),
        ]
    )
    err = " ".join(capsys.readouterr().err.split())
    assert (
        code == 1
        and "the remote environment failed its check before training" in err
        and "401" in err
        and "Traceback" not in err
    )
    assert not (out / "metrics.jsonl").exists()


def test_train_refuses_a_dead_server_before_training_naming_it(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    started = time.perf_counter()
    code = main(
        [
            "train",
            MAIN,
            *QUICK,
            "--set",
            "data.task=colour_turns",
            "--set",
            f"rollout.env_url={url}",
            "--set",
            "rollout.env_timeout_s=2",
            "--set",
            "trainer.steps=1",
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1 and f"environment server {url}: GET /health: no good answer" in err, err
    assert time.perf_counter() - started < 60
