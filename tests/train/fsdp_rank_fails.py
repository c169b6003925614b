"""Run under torchrun (2 processes, gloo): rank 1 fails at the start of its first update while rank 0 goes on into
the sharded forward (a collective rank 1 never joins). Rank 1 must say why at once and leave; torchrun then stops
rank 0. The test times the whole job."""

from __future__ import annotations

import os
import sys

import vlmreg
from vlmreg.train.recipe import Trainer

if os.environ.get("RANK") == "1":

    def fail(self, batch):
        raise RuntimeError("injected failure on rank 1")

    Trainer.update = fail

vlmreg.train(
    sys.argv[1],
    overrides=[
        "trainer.steps=2",
        "trainer.format_warmup_steps=0",
        "trainer.prompts_per_step=4",
        "rollout.group_size=4",
        "eval.every=0",
        "logging.rollout_page_every=0",
    ],
    output_dir=sys.argv[2],
)
