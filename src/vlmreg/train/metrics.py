"""Where step metrics go: ``metrics.jsonl`` (one object per step), TensorBoard when installed, the console."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter"]


class MetricsWriter:
    def __init__(self, output_dir: Path, *, tensorboard: bool, resume_step: int | None = None, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.tensorboard = None
        if not enabled:  # not the main process
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():  # drop lines a crashed run wrote after its last checkpoint
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
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
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        if self.tensorboard is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tensorboard.add_scalar(key.replace(".", "/"), value, step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
