"""An MLflow metrics sink for vlmreg (``[logging] sinks = ["mlflow"]``), registered through
``vlmreg_register_metrics_sinks``. ``mlflow`` is imported when a run opens the sink, never at plugin load."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmreg import MetricsSink, VlmregError, hookimpl

__version__ = "0.1.0"
RUN_ID_FILE = "mlflow_run_id"


class MlflowSink:
    """One MLflow run: opened (or resumed) here, one ``log_metrics`` per step, ended by `close`."""

    def __init__(self, ctx: Any) -> None:
        try:
            # deferred: optional, its absence is handled here
            import mlflow  # noqa: PLC0415
        except ImportError as exc:
            raise VlmregError(f"metrics sink 'mlflow' needs mlflow (pip install mlflow-skinny): {exc}") from None
        self.mlflow = mlflow
        output = Path(ctx.output_dir)
        # a local file store: MLflow 3 keeps it (in maintenance mode) on request
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((output / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "vlmreg"))
        id_file = output / RUN_ID_FILE
        run_id = id_file.read_text().strip() if ctx.resume_step is not None and id_file.is_file() else None
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else output.name)
        if run_id is None:
            id_file.write_text(self.run.info.run_id + "\n")
            # MLflow: strings, <= 6000 chars
            params = {name: str(value)[:6000] for name, value in ctx.config_values().items()}
            if params:
                mlflow.log_params(params)

    def write(self, record: dict[str, Any]) -> None:
        metrics = {
            key: float(value)
            for key, value in record.items()
            if key != "step"
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
        }
        self.mlflow.log_metrics(metrics, step=int(record["step"]))

    def close(self) -> None:
        self.mlflow.end_run()


@hookimpl
def vlmreg_register_metrics_sinks(register: Callable[[MetricsSink], None]) -> None:
    """Register ``mlflow``."""
    register(
        MetricsSink(
            name="mlflow",
            open=MlflowSink,
            description="every step's metrics in an MLflow run (OUTPUT/mlruns by default)",
        )
    )
