"""A third-party vlmreg plugin registering an objective and two rewards, exactly as vlmreg's built-ins do.

- objective ``reinforce``: plain REINFORCE with TIS weights, a mean over the step's loss tokens,
  ``L = - sum_t w_t * A_i * logp_t / (loss tokens in the step)``; nothing is clipped;
- reward ``one_word``: 1.0 when the answer is a single word, else 0.0 (synchronous);
- reward ``slow_exact_match``: ``exact_match`` computed by an ``async def`` (as one that calls a reward-model server
  would be), with a 5 s timeout.

``VLMREG_EXTRAS_TRACE=FILE`` appends one line per call of each (``objective``, ``one_word``, ``slow_exact_match``),
to see that they ran. Nothing here imports torch at import time.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from vlmreg import Objective, Reward, hookimpl

__version__ = "0.1.0"


def _trace(what: str) -> None:
    path = os.environ.get("VLMREG_EXTRAS_TRACE")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(what + "\n")


def reinforce(x: Any) -> tuple[Any, Any]:
    """``x`` is a ``vlmreg.train.losses.LossInputs`` for one micro-batch; the loss is normalised by the whole step."""
    import torch

    _trace("objective")
    loss = -(x.weights * x.advantages * x.logp).sum() / max(x.total_tokens, 1)
    return loss, torch.zeros_like(x.logp, dtype=torch.bool)


def one_word(completion: str, answer: str) -> float:
    _trace("one_word")
    return 1.0 if len(completion.split()) == 1 else 0.0


async def slow_exact_match(completion: str, answer: str) -> float:
    _trace("slow_exact_match")
    await asyncio.sleep(0.001)  # where a reward-model call would await
    return 1.0 if completion.strip().rstrip(".").lower() == str(answer).strip().lower() else 0.0


@hookimpl
def vlmreg_register_objectives(register):
    register(Objective(name="reinforce", loss=reinforce, clip=(0.2, 0.28), description="REINFORCE with TIS, token mean, no clip"))


@hookimpl
def vlmreg_register_rewards(register):
    register(Reward(name="one_word", fn=one_word, description="1 for a one-word answer"))
    register(Reward(name="slow_exact_match", fn=slow_exact_match, description="exact_match, async", timeout_s=5.0))
