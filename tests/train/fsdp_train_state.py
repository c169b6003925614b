"""Run under torchrun (2 processes, gloo): ``vlmreg.train(config, output_dir, overrides..., [--resume])``, then, before
the trainer's cleanup, every trainable weight and optimizer state as it is in memory, gathered whole
(``full_tensor``), saved by rank 0 to ``OUTPUT_DIR/final-<steps>.pt`` with ``torch.save``: the run's state read without
its checkpoint files, so two runs can be compared independently of how checkpoints are written.

Usage: fsdp_train_state.py CONFIG OUTPUT_DIR resume|fresh OVERRIDE..."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import vlmreg
from vlmreg.train.distributed import full_tensor
from vlmreg.train.recipe import Trainer

config, output_dir, mode, overrides = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
cleanup = Trainer.cleanup


def dump_then_cleanup(self: Trainer, *, failed: BaseException | None = None) -> None:
    if failed is None:
        params = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        names = {id(p): name for name, p in params.items()}
        found = {name: full_tensor(p) for name, p in params.items()}
        for p in params.values():
            for key, value in self.optimizer.state.get(p, {}).items():
                found[f"{names[id(p)]}::{key}"] = full_tensor(value)
        if self.main:
            torch.save(found, output_dir / f"final-{self.step}.pt")
    cleanup(self, failed=failed)


Trainer.cleanup = dump_then_cleanup  # type: ignore[method-assign]
vlmreg.train(config, overrides=overrides, output_dir=output_dir, resume=mode == "resume", log=print)
