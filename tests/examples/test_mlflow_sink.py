"""The MLflow metrics sink of `examples/plugins/vlmreg-mlflow`: a real run's steps, read back by MLflow's own client."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
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
    'logging.sinks=["mlflow"]',
]


@pytest.fixture
def mlflow_plugin(vlmreg_add_plugin, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "plugins" / "vlmreg-mlflow" / "src"))
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    module = importlib.import_module("vlmreg_mlflow")
    vlmreg_add_plugin(module, "vlmreg-mlflow")
    yield module
    sys.modules.pop("vlmreg_mlflow", None)


def test_every_step_lands_in_one_mlflow_run_and_a_resume_continues_it(mlflow_plugin, tmp_path, capsys):
    # deferred: mlflow is an optional extra
    from mlflow.tracking import MlflowClient  # noqa: PLC0415

    out = tmp_path / "run"
    assert main(["train", MAIN, *QUICK, "--set", "trainer.steps=2", "--output-dir", str(out)]) == 0
    assert main(["train", MAIN, *QUICK, "--set", "trainer.steps=4", "--output-dir", str(out), "--resume"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "vlmreg"]
    runs = client.search_runs([experiment.experiment_id])
    # resumed, not a new run
    assert len(runs) == 1 and runs[0].info.run_id == (out / "mlflow_run_id").read_text().strip()
    run = runs[0]
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (r["step"], r["reward_mean"]) for r in records
    ]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4]
    assert run.data.params["trainer.learning_rate"] == "0.003" and run.data.params["model.family"] == "qwen3_vl"


def test_the_plugin_loads_without_importing_mlflow(tmp_path):
    """Listing plugins (or any run that does not name the sink) never imports mlflow."""

    source = str(ROOT / "examples" / "plugins" / "vlmreg-mlflow" / "src")
    code = (
        f"import sys; sys.path.insert(0, {source!r}); import vlmreg, vlmreg_mlflow; "
        "vlmreg.register_plugin(vlmreg_mlflow, name='m');from vlmreg.sdk.registry import get_sink_registry; assert "
        "'mlflow' in get_sink_registry().names();print('mlflow' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
