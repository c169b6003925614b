"""Where step metrics go: ``metrics.jsonl`` (one object per step, always), and the metrics sinks ``[logging] sinks``
names (registered through ``vlmreg_register_metrics_sinks``; TensorBoard built in, added by ``[logging] tensorboard``
when installed)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_sink_registry
from vlmreg.sdk.sink import SinkContext

__all__ = ["MetricsWriter"]


def records_up_to(path: Path, step: int, log: Callable[[str], None]) -> list[str]:
    """The lines of ``path`` for steps up to ``step``; a partial last line (a run killed mid-write) is dropped,
    warned."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    kept = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if number == len(lines):  # no newline after it: the write was cut short
                log(
                    f"warning: {path}: dropped a partial last line ({len(line)} characters; the run was stopped while "
                    "writing it)"
                )
                continue
            raise VlmregError(f"{path}:{number} is not a JSON object; fix or delete that line, then resume again")
        number_of_step = record.get("step", 0)
        if not isinstance(number_of_step, int) or number_of_step <= step:
            kept.append(line)
    return kept


class MetricsWriter:
    def __init__(
        self,
        output_dir: Path,
        *,
        tensorboard: bool,
        resume_step: int | None = None,
        enabled: bool = True,
        log: Callable[[str], None] = print,
        sinks: tuple[str, ...] = (),
        config: Any = None,
    ) -> None:
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.sinks: list[tuple[str, Any]] = []
        if not enabled:  # not the main process
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():  # drop lines a crashed run wrote after its last checkpoint
            kept = records_up_to(self.path, resume_step, log)
            partial = self.path.with_name(".metrics.jsonl.tmp")
            partial.write_text("".join(line + "\n" for line in kept))
            os.replace(partial, self.path)  # never half a file, even if killed now
        elif resume_step is None:
            self.path.write_text("")
        names = list(dict.fromkeys(sinks))
        if tensorboard and "tensorboard" not in names and importlib.util.find_spec("tensorboard") is not None:
            names.append("tensorboard")  # [logging] tensorboard: when the package is there (it is optional)
        if names:
            registry, context = get_sink_registry(), SinkContext(output_dir, config, resume_step)
            for name in names:
                sink = registry.get(name)
                try:
                    self.sinks.append((name, sink.open(context)))
                except VlmregError:
                    raise
                except Exception as exc:
                    raise VlmregError(
                        f"metrics sink {name!r} ({registry.plugin_of(name).origin}) could not open: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(clean) + "\n")
        except OSError as exc:  # a full disk, a directory made read-only mid-run
            raise VlmregError(f"could not write {self.path}: {exc.strerror or exc}") from exc
        for name, sink in self.sinks:
            try:
                sink.write(dict(record))
            except Exception as exc:
                raise VlmregError(
                    f"metrics sink {name!r} failed writing step {record.get('step')}: {type(exc).__name__}: {exc}"
                ) from exc

    def close(self) -> None:
        for _, sink in self.sinks:
            sink.close()
        self.sinks = []
