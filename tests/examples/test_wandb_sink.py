"""The W&B metrics sink of `examples/plugins/vlmreg-wandb`: a real run, offline, read back from the run file wandb
itself writes (its records decoded with wandb's own protobuf classes), and a resume continuing the same W&B run.

wandb 0.31 ships no Python reader for its ``.wandb`` files (its core is in Go), so `_records` undoes the file's framing
(a ``:W&B`` header, then LevelDB-log chunks: crc32, length, type, in 32 KiB blocks) and hands every payload to
``wandb.proto.wandb_internal_pb2.Record``: what a step logged, and at which step, is wandb's own decoding."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlmreg.cli import main

ROOT = Path(__file__).resolve().parents[2]
MAIN = str(ROOT / "examples" / "configs" / "qwen3_vl_tiny.toml")
QUICK = [
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
    "trainer.save_every=2",
    "--set",
    'logging.sinks=["wandb"]',
]


@pytest.fixture
def wandb_plugin(vlmreg_add_plugin, monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "plugins" / "vlmreg-wandb" / "src"))
    for name in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_API_KEY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    module = importlib.import_module("vlmreg_wandb")
    vlmreg_add_plugin(module, "vlmreg-wandb")
    yield module
    sys.modules.pop("vlmreg_wandb", None)


def _offline_runs(out: Path) -> list[Path]:
    return sorted((out / "wandb").glob("offline-run-*"))


def _records(path: Path):
    # deferred: wandb is an optional extra
    from wandb.proto import wandb_internal_pb2  # noqa: PLC0415

    data, block, pos, parts = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0:  # zero padding
            pos += left
            continue
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record
            parts = b""


def _history(run: Path) -> dict[int, dict[str, float]]:
    """step -> {metric: value}, as wandb recorded each ``log`` (none while its file is not there yet)."""
    files = list(run.glob("run-*.wandb"))
    if not files:
        return {}
    (path,) = files
    rows = {}
    for record in _records(path):
        if record.WhichOneof("record_type") == "history":
            items = {
                (item.key or ".".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item
            }
            rows[int(record.history.step.num)] = items
    return rows


def _history_of(run: Path, steps: list[int]) -> dict[int, dict[str, float]]:
    """`_history` once it holds ``steps``: wandb-core, a process of its own, may still be writing the offline file when
    `train` returns (a loaded machine read it empty once, and once without the resumed steps); 60 s at most."""
    deadline = time.monotonic() + 60
    history = _history(run)
    while sorted(history) != steps and time.monotonic() < deadline:
        time.sleep(0.5)
        history = _history(run)
    return history


def _config(run: Path) -> dict[str, object]:
    (path,) = run.glob("run-*.wandb")
    config = {}
    for record in _records(path):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):  # the run record carries the config given to wandb.init; config records, changes
            update = record.run.config.update if kind == "run" else record.config.update
            config.update({(item.key or ".".join(item.nested_key)): json.loads(item.value_json) for item in update})
    return config


def test_each_step_lands_in_the_w_and_b_run_and_a_resume_continues_it(wandb_plugin, tmp_path):
    out = tmp_path / "run"
    assert main(["train", MAIN, *QUICK, "--set", "trainer.steps=2", "--output-dir", str(out)]) == 0
    run_id = (out / "wandb_run_id").read_text().strip()
    (first,) = _offline_runs(out)
    assert first.name.endswith("-" + run_id)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    history = _history_of(first, [1, 2])
    assert sorted(history) == [1, 2]
    for r in records:
        assert history[r["step"]]["reward_mean"] == pytest.approx(r["reward_mean"]) and history[r["step"]][
            "loss"
        ] == pytest.approx(r["loss"])
    config = _config(first)
    assert config["trainer.learning_rate"] == 0.003 and config["model.family"] == "qwen3_vl"

    assert main(["train", MAIN, *QUICK, "--set", "trainer.steps=4", "--output-dir", str(out), "--resume"]) == 0
    runs = _offline_runs(out)
    assert len(runs) == 2 and all(r.name.endswith("-" + run_id) for r in runs)  # the same W&B run, continued
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = _history_of(runs[-1], [3, 4])
    assert sorted(resumed) == [3, 4]
    assert [resumed[r["step"]]["reward_mean"] for r in records[2:]] == pytest.approx(
        [r["reward_mean"] for r in records[2:]]
    )


def test_the_plugin_loads_without_importing_wandb():
    """Listing plugins (or any run that does not name the sink) never imports wandb."""

    source = str(ROOT / "examples" / "plugins" / "vlmreg-wandb" / "src")
    code = (
        f"import sys; sys.path.insert(0, {source!r}); import vlmreg, vlmreg_wandb; "
        "vlmreg.register_plugin(vlmreg_wandb, name='w');from vlmreg.sdk.registry import get_sink_registry; assert "
        "'wandb' in get_sink_registry().names();print('wandb' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
