"""`ServerProcess`: a rollout server the trainer launched, watched so that its death is an error at once.

The process runs in a session of its own (a Ctrl-C at the terminal reaches the trainer, which stops it in order), its
output goes to a log file, and `check_alive` turns an exit at any time (before it is ready, or mid-run) into a
`VlmregError` with the exit code and the log's last lines. `stop` ends the whole process group (vLLM's engine core and
workers too).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from vlmreg.sdk.errors import VlmregError

__all__ = ["ServerProcess"]


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
