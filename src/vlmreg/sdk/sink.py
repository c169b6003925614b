"""`MetricsSink`: somewhere step metrics go, registered by name through ``vlmreg_register_metrics_sinks``.

``[logging] sinks`` names the sinks a run writes to, besides ``metrics.jsonl`` (always written: resume reads it).
``open(context)`` receives a `vlmreg.train.metrics.SinkContext` (``output_dir``, ``config``, ``resume_step``) and
returns an object with ``write(record)`` (one step's metrics, a dict with ``step``) and ``close()``. Import the
sink's library (W&B, MLflow, ...) inside ``open``, so that a run that does not use it never imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from vlmreg.sdk.descriptor import _check_callable, _check_name

__all__ = ["MetricsSink"]


@attrs.frozen(kw_only=True, eq=False)
class MetricsSink:
    """A metrics destination: ``open(context) -> sink`` with ``write(record)`` and ``close()``."""

    name: str = attrs.field(validator=_check_name)
    open: Callable[[Any], Any] = attrs.field(validator=_check_callable(optional=False, what="a callable taking a SinkContext"))
    description: str = ""
