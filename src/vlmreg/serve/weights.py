"""The server's end of weight sync: new weights arrive between batches, never under a request in flight.

``POST /v1/weights {"step": N}`` receives one sync from the trainer's process group (NCCL or gloo: the
server joined it at start with ``--weights-from``); ``{"step": N, "path": DIR}`` loads a checkpoint directory
written by the filesystem transport. Either way the tensors are checked against the served model (names,
shapes, dtypes) before anything is copied, applied on the model's own thread between two batches, and the
answer comes back once they are in: the trainer waits for it before sampling again.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from vlmreg.broadcast import BroadcastError, FilesystemReader, LayoutMismatchError, Receiver, apply_weights
from vlmreg.loading.load import LoadedModel
from vlmreg.serve.protocol import RequestError

__all__ = ["WeightUpdates"]


class WeightUpdates:
    """Applies weight syncs to a served model, one at a time."""

    def __init__(self, loaded: LoadedModel, between_batches: Any, receiver: Receiver | None = None, timeout_s: float = 120.0):
        self.loaded, self.between_batches, self.receiver, self.timeout_s = loaded, between_batches, receiver, timeout_s
        self.step: int | None = None
        self._lock = threading.Lock()
        self.joined = threading.Event()  # cleared while `Server.receive_weights_from` joins the weight process group
        self.joined.set()

    def update(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("step"), int) or isinstance(body.get("step"), bool):
            raise RequestError("step", "POST /v1/weights takes {\"step\": <int>} and, for the filesystem transport, \"path\"")
        unknown = set(body) - {"step", "path"}
        if unknown:
            raise RequestError(sorted(unknown)[0], f"unknown field {sorted(unknown)[0]!r} (fields: step, path)")
        with self._lock:
            try:
                tensors = self._fetch(body)
                applied = self.between_batches(lambda model: apply_weights(self.loaded.resolved, tensors)).result(self.timeout_s)
            except LayoutMismatchError as exc:
                raise RequestError("weights", f"the weights do not fit the served model, nothing was applied: {exc}", status=409) from None
            except BroadcastError as exc:
                raise RequestError("weights", str(exc), status=503, kind="server_error") from None
            self.step = body["step"]
        return {"object": "weights", "step": self.step, "tensors": applied}

    def _fetch(self, body: dict[str, Any]) -> dict[str, Any]:
        if "path" in body:
            path = body["path"]
            if not isinstance(path, str) or not FilesystemReader.is_complete(Path(path)):
                raise RequestError("path", f"{path!r} is not a complete weights directory written by the filesystem transport")
            _, tensors = FilesystemReader(Path(path).parent).load(Path(path), device=self.loaded.device)
            return tensors
        if self.receiver is None and not self.joined.is_set():
            self.joined.wait(self.timeout_s)  # the trainer may ask before this server's join has returned
        if self.receiver is None:
            raise RequestError(
                "step", "this server joined no weight process group; start it with --weights-from HOST:PORT, or send a path", status=409
            )
        return self.receiver.receive(timeout_s=self.timeout_s)
