"""What Ctrl-C, a resume with nothing left to train, and a refused run leave behind, and what they say.

Ctrl-C is a real SIGINT to a real `vlmreg train` process; the command it prints is then run, through a shell, as
printed. Refused runs are real CLI runs; the directories are looked at on disk afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vlmreg
from vlmreg.cli import build_parser, main
from vlmreg.cli.train import rerun_command

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml")
FAST = [
    "--set",
    "trainer.format_warmup_steps=0",
    "--set",
    "eval.every=0",
    "--set",
    "logging.rollout_page_every=0",
    "--set",
    "trainer.prompts_per_step=2",
    "--set",
    "rollout.group_size=2",
    "--set",
    "rollout.max_tokens=2",
]
BIN = Path(sys.executable).parent  # where the installed `vlmreg` command lives beside this Python


def steps_in_metrics(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def start_and_interrupt(args: list[str], ready: callable, tmp_path: Path) -> tuple[int, str, str]:
    """Start ``vlmreg ARGS`` in ``tmp_path``, SIGINT it once ``ready()`` holds; its exit status, stdout and stderr."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "400", "PYTHONFAULTHANDLER": "1"}
    # Ctrl-C as a terminal delivers it: a test run started in the background has SIGINT ignored, which its children
    # inherit (see tests/serve/test_server.py); the trainer gets SIGINT's default disposition, as in a foreground shell.
    process = subprocess.Popen(
        [str(BIN / "vlmreg"), *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert process.poll() is None, f"vlmreg train ended before it could be interrupted: {process.communicate()}"
            assert time.monotonic() < deadline, "vlmreg train did not get far enough within 120 s"
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, out, err


def test_ctrl_c_names_the_checkpoint_and_prints_the_exact_command_which_resumes_the_same_run(tmp_path):
    out = tmp_path / "my run"  # a space: the command must be quoted for the shell
    args = [
        "train",
        MAIN,
        *FAST,
        "--set",
        "trainer.save_every=2",
        "--set",
        "trainer.steps=12",
        "--output-dir",
        str(out),
    ]
    code, _, err = start_and_interrupt(args, lambda: (out / "checkpoints" / "latest").is_file(), tmp_path)
    assert code == 130, err
    found = re.search(
        r"interrupted after step (\d+); the last checkpoint is step (\d+), (.+?)(?: \(steps? (\d+)(?:-(\d+))? "
        r"(?:was|were) not saved\))?\. "
        r"Continue from it: (.+)$",
        err.strip(),
    )
    assert found, err
    step, saved = int(found.group(1)), int(found.group(2))
    assert saved % 2 == 0 and saved <= step < 12
    assert Path(found.group(3)) == out / "checkpoints" / f"step_{saved:06d}"
    assert (out / "checkpoints" / "latest").read_text() == f"step_{saved:06d}"  # what is on disk, not a promise
    if step > saved:  # "step N was not saved" or "steps M-N were not saved"
        assert [int(g) for g in found.group(4, 5) if g] == ([step] if step == saved + 1 else [saved + 1, step])
    command = found.group(6)
    assert shlex.split(command) == ["vlmreg", *args, "--resume"]  # the exact command line, plus --resume

    # The command as printed, through a shell, from where the run was started: it resumes this run directory.
    resumed = subprocess.run(
        command,
        shell=True,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"},
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {out / 'checkpoints' / f'step_{saved:06d}'} (step {saved})" in resumed.stdout
    assert steps_in_metrics(out) == list(range(1, 13))
    assert (out / "checkpoints" / "latest").read_text() == "step_000012"
    assert not (tmp_path / "runs").exists()  # not the config's own trainer.output_dir


def test_ctrl_c_before_any_checkpoint_says_there_is_none_and_how_to_start_again(tmp_path):
    out = tmp_path / "run"
    args = [
        "train",
        MAIN,
        *FAST,
        "--set",
        "trainer.save_every=0",
        "--set",
        "trainer.steps=500",
        "--output-dir",
        str(out),
    ]
    metrics = out / "metrics.jsonl"
    code, _, err = start_and_interrupt(args, lambda: metrics.is_file() and metrics.stat().st_size > 0, tmp_path)
    assert code == 130, err
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    message = " ".join(err.split())
    assert re.search(
        r"interrupted after step \d+; no checkpoint was written \(trainer\.save_every = 0: only at the end\), "
        r"so there is nothing to resume\. Start again: ",
        message,
    ), err
    command = message.split("Start again: ", 1)[1]
    # the directory holds metrics: a plain rerun is refused
    assert shlex.split(command) == ["vlmreg", *args, "--overwrite"]
    assert "--resume" not in command


@pytest.mark.parametrize(
    "typed",
    [
        ["train", "run.toml", "--set", "trainer.steps=9", "--output-dir", "runs/a b", "--overwrite"],
        ["train", "--output-dir=runs/x", "run.toml", "--set=model.lora={r=8}", "--over", "--allow-config-change"],
        ["train", "run.toml", "--res", "--allow", "--set", "trainer.steps=20"],
    ],
    ids=["overwrite", "abbreviated", "resumed"],
)
def test_the_printed_commands_parse_as_the_run_typed_with_resume_or_a_fresh_start(typed):
    """argparse, reading the printed command, sees the typed run with --resume (or, to start again, without it)."""

    parser = build_parser()
    as_typed = vars(parser.parse_args(typed))
    for resume, overwrite in ((True, False), (False, True), (False, False)):
        words = shlex.split(rerun_command(typed, resume=resume, overwrite=overwrite))
        assert words[0] == "vlmreg"
        parsed = vars(parser.parse_args(words[1:]))
        expected = {
            **as_typed,
            "resume": resume,
            "overwrite": overwrite,
            "allow_config_change": as_typed["allow_config_change"] and resume,
        }
        assert parsed == expected, words
    if "--res" in typed:  # a resumed run's command keeps its words as typed
        assert shlex.split(rerun_command(typed, resume=True)) == ["vlmreg", *typed]


# -- a resume with nothing left to train -----------------------------------------------------------------


def test_a_resume_at_or_past_the_last_step_says_nothing_was_trained_and_leaves_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["train", MAIN, *FAST, "--set", "trainer.save_every=1", "--output-dir", str(out)]
    assert main([*base, "--set", "trainer.steps=3"]) == 0
    capsys.readouterr()
    checkpoints = {p.name: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")}
    for steps in (3, 2):  # at the checkpoint's step, and below it: exit 0, with a note naming both numbers
        assert main([*base, "--set", f"trainer.steps={steps}", "--resume"]) == 0
        printed = " ".join(capsys.readouterr().out.split())
        assert (
            f"note: nothing trained: the checkpoint is at step 3 and trainer.steps = {steps}, so the run stays at step "
            "3; raise trainer.steps above 3 (--set trainer.steps=N) to train further"
        ) in printed
        assert "done:" not in printed
        assert steps_in_metrics(out) == [1, 2, 3]
        assert {p.name: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")} == checkpoints  # not rewritten


def test_the_python_api_reports_that_a_resume_trained_nothing(tmp_path):
    out = tmp_path / "run"
    sets = [s for s in FAST if s != "--set"] + ["trainer.steps=2"]
    first = vlmreg.train(MAIN, overrides=sets, output_dir=out, log=lambda message: None)
    assert (first.step, first.steps_trained) == (2, 2)
    notes: list[str] = []
    again = vlmreg.train(MAIN, overrides=sets, output_dir=out, resume=True, log=notes.append)
    assert (again.step, again.steps_trained) == (2, 0)
    assert any(n.startswith("note: nothing trained: the checkpoint is at step 2 and trainer.steps = 2") for n in notes)


# -- refused runs leave nothing behind -------------------------------------------------------------------


def test_a_refused_run_removes_the_folders_it_created(tmp_path, capsys):
    out = tmp_path / "new" / "deeper" / "run"
    assert main(["train", MAIN, *FAST, "--output-dir", str(out), "--resume"]) == 1
    assert f"--resume: no checkpoint in {out / 'checkpoints'}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither the run folder nor the two above it that the claim made


def test_a_refused_run_leaves_an_existing_folder_as_it_was(tmp_path, capsys):
    empty, earlier = tmp_path / "empty", tmp_path / "earlier"
    empty.mkdir()
    earlier.mkdir()
    (earlier / ".lock").write_text("4242\n")  # left by an earlier run: not this run's to remove
    for folder in (empty, earlier):
        assert main(["train", MAIN, *FAST, "--output-dir", str(folder), "--resume"]) == 1
    capsys.readouterr()
    assert list(empty.iterdir()) == []
    assert [p.name for p in earlier.iterdir()] == [".lock"]


def test_a_run_that_fails_in_setup_before_writing_anything_leaves_no_folder(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text(
        json.dumps(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "missing.png"}},
                            {"type": "text", "text": "?"},
                        ],
                    }
                ],
                "answer": "Red",
            }
        )
        + "\n"
    )
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\ninit = "random"\nfamily = "qwen3_vl"\nsize = "tiny"\n\n[trainer]\ndevice = "cpu"\nsteps = 1\n\n'
        '[data]\npaths = ["data.jsonl"]\n\n[reward]\nfunctions = { exact_match = 1.0 }\n'
    )
    out = tmp_path / "out" / "run"
    assert main(["train", str(config), "--output-dir", str(out)]) == 1
    assert "image file not found" in capsys.readouterr().err  # refused after the claim, once the data is read
    assert not (tmp_path / "out").exists()
