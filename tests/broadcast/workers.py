"""A receiver process for the transport tests: apply each sync, save the model's state, wait for the test's go."""

from __future__ import annotations

import os
import time
from pathlib import Path

from safetensors.torch import save_file

import vlmreg
from vlmreg.broadcast import Receiver, SenderClosed, apply_weights
from vlmreg.testing import tiny_model


def wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.02)


def receiver_main(rank: int, port: int, directory: str, family: str, seed: int, token: str) -> None:
    tmp = Path(directory)
    resolved = vlmreg.resolve(tiny_model(family, seed=seed))
    receiver = Receiver(resolved, host="127.0.0.1", port=port, rank=rank, timeout_s=30, token=token)
    syncs = 0
    while True:
        try:
            received = receiver.receive(timeout_s=60)
        except SenderClosed:
            break
        syncs += 1
        apply_weights(resolved, received)
        state = {k: v.contiguous() for k, v in resolved.model.state_dict().items()}
        save_file(state, tmp / f".rank{rank}-sync{syncs}.partial")
        os.replace(tmp / f".rank{rank}-sync{syncs}.partial", tmp / f"rank{rank}-sync{syncs}.safetensors")
        wait_for(tmp / f"go{syncs}")
    receiver.close()
