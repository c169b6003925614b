"""vlmreg's built-in metrics sink, registered through ``vlmreg_register_metrics_sinks`` like a third party's.

``tensorboard``: the step's numeric metrics as TensorBoard scalars in ``OUTPUT/tensorboard`` (needs the
``tensorboard`` package; ``[logging] tensorboard = true`` adds it when that package is installed, and naming it in
``[logging] sinks`` without the package is an error). Importing this module is cheap.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.hookspecs import hookimpl
from vlmreg.sdk.sink import MetricsSink

__all__ = ["BUILTIN", "TensorBoardSink"]


class TensorBoardSink:
    def __init__(self, directory: Any) -> None:
        try:
            # deferred: fails to import here (ModuleNotFoundError: No module named 'tensorboard')
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
        except ImportError as exc:
            raise VlmregError(
                f"metrics sink 'tensorboard' needs the tensorboard package (pip install tensorboard): {exc}"
            ) from None
        self.writer = SummaryWriter(str(directory))

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if (
                key != "step"
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            ):
                self.writer.add_scalar(key.replace(".", "/"), value, step)

    def close(self) -> None:
        self.writer.close()


def _tensorboard(ctx: Any) -> TensorBoardSink:
    return TensorBoardSink(ctx.output_dir / "tensorboard")


BUILTIN = (MetricsSink(name="tensorboard", open=_tensorboard, description="TensorBoard scalars in OUTPUT/tensorboard"),)


@hookimpl
def vlmreg_register_metrics_sinks(register: Callable[[MetricsSink], None]) -> None:
    """Register ``tensorboard``."""
    for sink in BUILTIN:
        register(sink)
