"""The server's end of weight sync: new weights arrive between batches, never under a request in flight.

``POST /v1/weights {"step": N}`` receives one sync from the trainer's process group (NCCL or gloo: the
server joined it at start with ``--weights-from``); ``{"step": N, "path": DIR}`` loads a checkpoint directory
written by the filesystem transport, which must lie under the server's ``weights_dir`` (``--weights-dir``; none:
paths are refused). Before anything is copied the payload is checked, and refused with nothing applied: a step
lower than the last one applied (409; the same step again is taken, a trainer re-sends it on resume), a directory
without a tensor every sync carries (409), any NaN or infinity (409 naming the first such tensor), and the
tensors against the served model (names, shapes, dtypes; 409). The tensors are applied on the model's own thread
between two batches, and the answer comes back once they are in: the trainer waits for it before sampling again.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vlmreg.broadcast import BroadcastError, FilesystemReader, LayoutMismatchError, Receiver, WeightPlan, apply_weights
from vlmreg.loading.load import LoadedModel
from vlmreg.serve.protocol import RequestError

__all__ = ["WeightUpdates", "first_non_finite", "required_tensors"]

_STEP_DIR = re.compile(r"^step_\d+$")


def required_tensors(loaded: LoadedModel) -> list[str]:
    """Checkpoint names every sync must carry: the language model and the lm_head (the vision tower and connectors
    are sent only when they change, so a directory may leave them out)."""
    d = loaded.resolved.descriptor
    plan = WeightPlan.from_resolved(loaded.resolved, include_frozen_vision=False)
    roots = tuple(r for r in (d.language_model_attr, d.lm_head_attr) if r)
    always = tuple(w for w in plan.weights if any(w.name.startswith(root + ".") for root in roots))
    return [name for name, _ in WeightPlan(d, always, False).shapes()]


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first tensor (in the payload's order) holding a NaN or an infinity; ``None`` when all are finite."""
    floats = [(name, t) for name, t in tensors.items() if t.is_floating_point() or t.is_complex()]
    if not floats:
        return None
    finite = torch.stack([torch.isfinite(t).all() for _, t in floats]).tolist()  # one device sync, not one per tensor
    return next((name for (name, _), ok in zip(floats, finite, strict=True) if not ok), None)


class WeightUpdates:
    """Applies weight syncs to a served model, one at a time."""

    def __init__(
        self, loaded: LoadedModel, between_batches: Any, receiver: Receiver | None = None, timeout_s: float = 120.0,
        weights_dir: str | Path | None = None,
    ):
        self.loaded, self.between_batches, self.receiver, self.timeout_s = loaded, between_batches, receiver, timeout_s
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
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
                if "path" in body:  # refused before anything is read
                    self._check_step(body["step"])
                tensors = self._fetch(body)
                self._check_step(body["step"])  # a received sync is taken off the wire first, so the sender is not left waiting
                bad = first_non_finite(tensors)
                if bad is not None:
                    raise RequestError(
                        "weights", f"tensor {bad!r} of step {body['step']} holds NaN or infinite values; nothing was applied", status=409,
                        code="non_finite_weights",
                    )
                applied = self.between_batches(lambda model: apply_weights(self.loaded.resolved, tensors)).result(self.timeout_s)
            except LayoutMismatchError as exc:
                raise RequestError("weights", f"the weights do not fit the served model, nothing was applied: {exc}", status=409) from None
            except BroadcastError as exc:
                raise RequestError("weights", str(exc), status=503, kind="server_error") from None
            self.step = body["step"]
        return {"object": "weights", "step": self.step, "tensors": applied}

    def _check_step(self, step: int) -> None:
        if self.step is not None and step < self.step:
            raise RequestError(
                "step", f"step {step} is older than step {self.step}, the last one applied; steps only move forward "
                "(the same step again is taken); nothing was applied", status=409, code="stale_step",
            )

    def _directory(self, path: Any) -> Path:
        """``path`` resolved (symlinks too), once it is known to lie under ``weights_dir``; else the refusal."""
        if not isinstance(path, str) or not path:
            raise RequestError("path", "\"path\" must be a non-empty string naming a weights directory")
        if self.weights_dir is None:
            raise RequestError(
                "path", "this server takes no weights directories: start it with --weights-dir DIR (the directory the trainer's "
                "filesystem transport writes to)", status=403, kind="permission_error", code="path_not_allowed",
            )
        root, target = self.weights_dir.resolve(), Path(path).resolve()
        if target == root or not target.is_relative_to(root):
            raise RequestError(
                "path", f"{path!r} is not under the server's --weights-dir {str(self.weights_dir)!r}", status=403,
                kind="permission_error", code="path_not_allowed",
            )
        if not _STEP_DIR.match(target.name):
            raise RequestError("path", f"{path!r} is not a step_NNNNNN directory written by the filesystem transport")
        if not FilesystemReader.is_complete(target):
            raise RequestError("path", f"{path!r} is not a complete weights directory written by the filesystem transport")
        return target

    def _fetch(self, body: dict[str, Any]) -> Mapping[str, torch.Tensor]:
        if "path" in body:
            path = self._directory(body["path"])
            try:
                _, tensors = FilesystemReader(path.parent).load(path, device=self.loaded.device)
            except Exception as exc:  # a truncated or corrupt shard or index: safetensors' own error, OSError, ValueError...
                raise RequestError("path", f"{body['path']!r}: cannot read the weights, nothing was applied: {type(exc).__name__}: {exc}", status=409,
                                   code="unreadable_weights") from None
            missing = [name for name in required_tensors(self.loaded) if name not in tensors]
            if missing:
                raise RequestError(
                    "path", f"{body['path']!r} lacks tensor {missing[0]!r} of the served model ({len(missing)} missing); nothing was applied",
                    status=409, code="incomplete_weights",
                )
            return tensors
        if self.receiver is None and not self.joined.is_set():
            self.joined.wait(self.timeout_s)  # the trainer may ask before this server's join has returned
        if self.receiver is None:
            raise RequestError(
                "step", "this server joined no weight process group; start it with --weights-from HOST:PORT, or send a path", status=409
            )
        return self.receiver.receive(timeout_s=self.timeout_s)
