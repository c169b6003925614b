"""`ServerProcess`: a rollout server the trainer launched, watched so that its death is an error at once.

The process runs in a session of its own (a Ctrl-C at the terminal reaches the trainer, which stops it in order), its
output goes to a log file, and `check_alive` turns an exit at any time (before it is ready, or mid-run) into a
`VlmregError` with the exit code and the log's last lines. `stop` ends the whole process group (vLLM's engine core and
workers too).

Where it runs: `server_environment` is the trainer's environment without torchrun's variables, and `server_gpus` the
GPUs a launched server gets (beside the trainer's, or after every trainer rank on this host).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from vlmreg.sdk.errors import VlmregError

__all__ = ["LAUNCHER_VARIABLES", "ServerProcess", "server_environment", "server_gpus"]


class ServerProcess:
    """A launched server: ``what`` names it in errors (``"vLLM"``, ``"vlmreg serve"``), ``url`` is where it listens."""

    def __init__(
        self,
        what: str,
        command: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        url: str,
        *,
        header: str | None = None,
    ) -> None:
        self.what, self.url, self.log_path = what, url, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log_file:
            if header:
                log_file.write(header + "\n")
                log_file.flush()
            self.process = subprocess.Popen(
                list(command), stdout=log_file, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def tail(self, lines: int = 5) -> str:
        """``: last | lines (log: PATH)`` of the server's log, for an error message."""
        text = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:] if self.log_path.exists() else []
        return (": " + " | ".join(line.strip() for line in text) if text else "") + f" (log: {self.log_path})"

    def check_alive(self) -> None:
        """Raise if the process has exited, whatever its exit code: a rollout server never ends by itself."""
        code = self.process.poll()
        if code is not None:
            raise VlmregError(f"{self.what} at {self.url} (pid {self.pid}) exited with code {code}{self.tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Terminate the server's process group, killing it after ``timeout_s``."""
        if self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


#: What torchrun puts in each trainer process's environment; a server the trainer launches is not one of its ranks.
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


def server_environment(**extra: str) -> dict[str, str]:
    """The environment for a server the trainer launches: the trainer's own, without torchrun's variables (a server
    that found them would take itself for a rank of the trainer's group), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(extra)
    return env


def server_gpu_indices(device: torch.device, where: str, count: int = 1, index: int = 0) -> range:
    """The GPUs of launched rollout server ``index`` as this process numbers them (`server_gpus`)."""
    trainers = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    first = (device.index or 0) + (trainers if where == "next" else 0) + index * count
    return range(first, first + count)


def server_gpus(device: torch.device, where: str, count: int = 1, index: int = 0) -> str:
    """``CUDA_VISIBLE_DEVICES`` for launched rollout server ``index`` (0-based): ``count`` GPUs (its tensor-parallel
    size) from the trainer's GPU on (``where = "same"``), or from the first GPU after every trainer process on this host
    (``"next"``: with ``torchrun``, the ``LOCAL_WORLD_SIZE`` ranks hold the GPUs from rank 0's on), server ``k``'s
    after server ``k - 1``'s. Indices count within the trainer's own ``CUDA_VISIBLE_DEVICES`` when it is set; a GPU
    that is not there is an error naming the setting."""
    trainers = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    indices = server_gpu_indices(device, where, count, index)
    held = f" after the trainer's {trainers} GPUs" if trainers > 1 and where == "next" else ""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        if indices[-1] >= len(visible):
            raise VlmregError(
                f"rollout.launch_gpu = {where!r} with tensor parallel {count}{_nth(index)}: GPUs "
                f"{indices[0]}..{indices[-1]}{held} are not all among CUDA_VISIBLE_DEVICES={','.join(visible)}"
            )
        return ",".join(visible[i] for i in indices)
    available = torch.cuda.device_count()
    if indices[-1] >= available:
        raise VlmregError(
            f"rollout.launch_gpu = {where!r} with tensor parallel {count}{_nth(index)}: this machine has {available} "
            f"GPU(s), so there is no GPU {indices[-1]}{held} for the server"
        )
    return ",".join(str(i) for i in indices)


def _nth(index: int) -> str:
    return f" (server {index + 1})" if index else ""
