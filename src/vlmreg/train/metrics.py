"""Where step metrics go: ``metrics.jsonl`` (one object per step), TensorBoard when installed, the console."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmreg.sdk.errors import VlmregError

__all__ = ["MetricsWriter"]


def records_up_to(path: Path, step: int, log: Callable[[str], None]) -> list[str]:
    """The lines of ``path`` for steps up to ``step``; a partial last line (a run killed mid-write) is dropped, warned."""
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
                log(f"warning: {path}: dropped a partial last line ({len(line)} characters; the run was stopped while writing it)")
                continue
            raise VlmregError(f"{path}:{number} is not a JSON object; fix or delete that line, then resume again")
        number_of_step = record.get("step", 0)
        if not isinstance(number_of_step, int) or number_of_step <= step:
            kept.append(line)
    return kept


class MetricsWriter:
    def __init__(
        self, output_dir: Path, *, tensorboard: bool, resume_step: int | None = None, enabled: bool = True, log: Callable[[str], None] = print
    ) -> None:
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.tensorboard = None
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
        self.tensorboard = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self.tensorboard = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(clean) + "\n")
        except OSError as exc:  # a full disk, a directory made read-only mid-run
            raise VlmregError(f"could not write {self.path}: {exc.strerror or exc}") from exc
        if self.tensorboard is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tensorboard.add_scalar(key.replace(".", "/"), value, step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
