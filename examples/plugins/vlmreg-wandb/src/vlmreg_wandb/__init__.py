"""A Weights & Biases metrics sink for vlmreg (``[logging] sinks = ["wandb"]``), registered through
``vlmreg_register_metrics_sinks``. ``wandb`` is imported when a run opens the sink, never at plugin load.

W&B reads its usual environment: ``WANDB_PROJECT`` (default ``vlmreg``), ``WANDB_ENTITY``, ``WANDB_MODE``
(``offline`` writes the run under ``OUTPUT/wandb`` for ``wandb sync`` later), ``WANDB_API_KEY``, ``WANDB_TAGS``.
The run is named after the output folder, its config is the run config's scalars by dotted name, and a resumed
vlmreg run (``--resume``) continues the same W&B run: its id is kept in ``OUTPUT/wandb_run_id``.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmreg import MetricsSink, VlmregError, hookimpl

__version__ = "0.1.0"
RUN_ID_FILE = "wandb_run_id"


class WandbSink:
    """One W&B run: started (or resumed) here, one ``log`` per step at that step, finished by `close`."""

    def __init__(self, ctx: Any) -> None:
        try:
            # deferred: optional, its absence is handled here
            import wandb  # noqa: PLC0415
        except ImportError as exc:
            raise VlmregError(f"metrics sink 'wandb' needs wandb (pip install wandb): {exc}") from None
        output = Path(ctx.output_dir)
        id_file = output / RUN_ID_FILE
        resumed = ctx.resume_step is not None and id_file.is_file()
        run_id = id_file.read_text().strip() if resumed else uuid.uuid4().hex[:8]  # W&B run ids: short, lower case
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "vlmreg"),
            id=run_id,
            resume="allow",
            name=output.name,
            dir=str(output),
            config=None if resumed else ctx.config_values(),
        )
        if not resumed:
            id_file.write_text(run_id + "\n")

    def write(self, record: dict[str, Any]) -> None:
        metrics = {
            key: float(value)
            for key, value in record.items()
            if key != "step"
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
        }
        self.run.log(metrics, step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


@hookimpl
def vlmreg_register_metrics_sinks(register: Callable[[MetricsSink], None]) -> None:
    """Register ``wandb``."""
    register(
        MetricsSink(
            name="wandb",
            open=WandbSink,
            description="every step's metrics in a Weights & Biases run (WANDB_MODE=offline: OUTPUT/wandb)",
        )
    )
