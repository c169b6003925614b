"""benchmarks/vllm_families.sh: its table step turns the check's JSON lines (a real report, from `vlmreg serve` standing
in for vLLM, and the line the script writes for a family that gave no report) into BENCHMARKS.md's rows, a family's
check and training lines making one row; a run without vLLM says so in every row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.testing.test_engine_parity import checkpoint, served
from vlmreg.testing.engine_parity import Comparison, check_engine

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_families.sh"


def table(*files: Path) -> list[str]:
    result = subprocess.run(
        ["bash", str(SCRIPT), "table", *map(str, files)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_rows_from_a_real_report_a_training_run_and_a_family_without_a_report(tmp_path: Path):
    directory = checkpoint("qwen3_vl", tmp_path / "ckpt")
    server, url = served(directory)
    try:
        report = check_engine("qwen3_vl", str(directory), url=url, log=lambda m: None).as_dict()
    finally:
        server.close()
    # a training line as `run_training` names its comparisons (tests/testing/test_engine_train.py runs it for real)
    steps = [Comparison(f"train step {k}: mismatch_kl", "PASS", "...", kl) for k, kl in ((1, 2.5e-4), (2, 3.1e-4))]
    training = {
        "family": "qwen3_vl",
        "ok": True,
        "dtype": "bfloat16",
        "error": None,
        "comparisons": [c.as_dict() for c in [*steps, Comparison("vlmreg train", "PASS", "2 synced steps")]],
    }
    missing = {
        "family": "glm4v",
        "ok": False,
        "comparisons": [],
        "dtype": "-",
        "error": "no report: timed out (stopped); stderr ends: x",
    }
    (tmp_path / "check.jsonl").write_text(json.dumps(report) + "\n" + json.dumps(missing) + "\n")
    (tmp_path / "train.jsonl").write_text(json.dumps(training) + "\n")
    header, rule, qwen, glm = table(tmp_path / "check.jsonl", tmp_path / "train.jsonl")
    assert header.startswith("| family | prompt ids = processor") and rule.startswith("| --- |")
    cells = [c.strip() for c in qwen.strip("|").split("|")]
    # attached: no AutoProcessor
    assert cells[:4] == ["qwen3_vl", "yes / yes / yes / yes", "yes / yes / yes / yes", "- / - / - / -"]
    assert float(cells[4].split()[0]) < 1e-4 and cells[4].endswith("(float32)")
    assert cells[6] == "2.5e-04, 3.1e-04" and cells[-1] == "PASS"  # the training line's steps, in the same row
    assert glm.startswith("| glm4v |") and "FAIL: no report: timed out" in glm


def test_without_vllm_every_row_says_so(tmp_path: Path):
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "WORK": str(tmp_path / "work"),
        "STAGGER": "0",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    result = subprocess.run(
        ["bash", str(SCRIPT), "check", "qwen3_vl"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "families.check.jsonl").read_text().splitlines()]
    assert [(r["family"], r["ok"], r["exit_code"]) for r in rows] == [("qwen3_vl", False, 2)]
    assert rows[0]["error"].startswith("vLLM is not importable")
    assert (
        "| qwen3_vl | - / - / - / - | - / - / - / - | - / - / - / - | - |" in result.stdout
        and "FAIL: vLLM is not importable" in result.stdout
    )
