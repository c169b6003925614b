"""`MetricsSink`: somewhere step metrics go, registered by name through ``vlmreg_register_metrics_sinks``.

``[logging] sinks`` names the sinks a run writes to, besides ``metrics.jsonl`` (always written: resume reads it).
``open(context)`` receives a `SinkContext` (``output_dir``, ``config``, ``resume_step``) and
returns an object with ``write(record)`` (one step's metrics, a dict with ``step``) and ``close()``. Import the
sink's library (W&B, MLflow, ...) inside ``open``, so that a run that does not use it never imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from vlmreg.sdk.field_checks import check_callable, check_name

__all__ = ["MetricsSink", "SinkContext"]


@attrs.frozen(kw_only=True, eq=False)
class MetricsSink:
    """A metrics destination: ``open(context) -> sink`` with ``write(record)`` and ``close()``."""

    name: str = attrs.field(validator=check_name)
    open: Callable[[Any], Any] = attrs.field(
        validator=check_callable(optional=False, what="a callable taking a SinkContext")
    )
    description: str = ""


@attrs.frozen
class SinkContext:
    """What a metrics sink's ``open`` gets: the run's output folder, its config, and the step it resumes from."""

    output_dir: Path
    config: Any
    resume_step: int | None

    def config_values(self) -> dict[str, str | int | float | bool]:
        """The run config's scalar settings by dotted name (``trainer.learning_rate``, ``model.family``, ...), what a
        tracker shows as the run's parameters; lists, tables of plugin options and unset values are left out."""
        out: dict[str, str | int | float | bool] = {}

        def walk(obj: Any, prefix: str) -> None:
            for field in attrs.fields(type(obj)):
                value = getattr(obj, field.name)
                if attrs.has(type(value)):
                    walk(value, f"{prefix}{field.name}.")
                elif isinstance(value, (str, int, float, bool)):
                    out[f"{prefix}{field.name}"] = value

        if self.config is not None and attrs.has(type(self.config)):
            walk(self.config, "")
        return out
