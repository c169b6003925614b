"""The server's end of weight sync: new weights arrive between batches, never under a request in flight.

``POST /v1/weights {"step": N}`` receives one sync from the trainer's process group (NCCL or gloo: the
server joined it at start with ``--weights-from``); ``{"step": N, "path": DIR}`` loads a checkpoint directory
written by the filesystem transport, which must lie under the server's ``weights_dir`` (``--weights-dir``; none:
paths are refused); a plugin's transport brings its own receiver (``--weights-transport``), which takes the bodies
with its fields (`vlmreg.serve.receivers`). Before anything is copied the payload is checked, and refused with nothing
applied: a step lower than the last one applied (409; the same step again is taken, a trainer re-sends it on resume), a
directory
without a tensor every sync carries (409), any NaN or infinity (409 naming the first such tensor), and the
tensors against the served model (names, shapes, dtypes; 409). The tensors are applied on the model's own thread
between two batches, and the answer comes back once they are in: the trainer waits for it before sampling again.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vlmreg.broadcast import BroadcastError, LayoutMismatchError, WeightPlan, apply_weights
from vlmreg.broadcast.plan import receiving_plan
from vlmreg.loading.load import LoadedModel
from vlmreg.sdk.registry import get_transport_registry
from vlmreg.sdk.transport import ReceiverContext
from vlmreg.serve.protocol import RequestError

__all__ = ["WeightUpdates", "first_non_finite", "required_tensors"]


def required_tensors(loaded: LoadedModel) -> list[str]:
    """Checkpoint names every sync must carry: the language model and the lm_head (the vision tower and connectors
    are sent only when they change, so a directory may leave them out); for a server that serves LoRA, the factors of
    each of its adapters (the frozen base weights come only with the first sync)."""
    adapters = [name for name, _ in receiving_plan(loaded.resolved).adapter_tensors()]
    if adapters:
        return adapters
    d = loaded.resolved.descriptor
    plan = WeightPlan.from_resolved(loaded.resolved, include_frozen_vision=False)
    roots = tuple(r for r in (d.language_model_attr, d.lm_head_attr) if r)
    always = tuple(w for w in plan.weights if any(w.name.startswith(root + ".") for root in roots))
    return [name for name, _ in WeightPlan(d, always, False).shapes()]


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first tensor (in the payload's order) holding a NaN or an infinity; ``None`` when all are
    finite."""
    floats = [(name, t) for name, t in tensors.items() if t.is_floating_point() or t.is_complex()]
    if not floats:
        return None
    finite = torch.stack([torch.isfinite(t).all() for _, t in floats]).tolist()  # one device sync, not one per tensor
    return next((name for (name, _), ok in zip(floats, finite, strict=True) if not ok), None)


class WeightUpdates:
    """Applies weight syncs to a served model, one at a time.

    Each sync comes through a transport's receiver (`vlmreg.serve.receivers`): the one whose ``fields`` are the
    body's fields besides ``step`` (``receiver``: the one taking bare ``{"step": N}`` bodies, a process group's).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        between_batches: Any,
        receiver: Any = None,
        timeout_s: float = 120.0,
        weights_dir: str | Path | None = None,
    ):
        self.loaded, self.between_batches, self.timeout_s = loaded, between_batches, timeout_s
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.receivers: list[Any] = []
        self.receiver = receiver
        if self.weights_dir is not None:  # --weights-dir: the filesystem transport's receiver
            spec = get_transport_registry().get("filesystem")
            assert spec.receiver is not None
            self.add(
                spec.receiver(
                    ReceiverContext(loaded=loaded, options={"directory": str(self.weights_dir)}, timeout_s=timeout_s)
                )
            )
        self.step: int | None = None
        self._lock = threading.Lock()
        # cleared while `Server.receive_weights_with` builds a receiver (joins a group, say)
        self.joined = threading.Event()
        self.joined.set()

    @property
    def receiver(self) -> Any:
        """The receiver of bare ``{"step": N}`` bodies (a process group's), or ``None``."""
        return next((r for r in self.receivers if not _fields(r)), None)

    @receiver.setter
    def receiver(self, value: Any) -> None:
        self.receivers = [r for r in self.receivers if _fields(r)]
        if value is not None:
            self.receivers.insert(0, value)

    def add(self, receiver: Any) -> None:
        """Take syncs through ``receiver`` too (it replaces one reading the same fields)."""
        self.receivers = [r for r in self.receivers if _fields(r) != _fields(receiver)] + [receiver]

    def update(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("step"), int) or isinstance(body.get("step"), bool):
            raise RequestError(
                "step", 'POST /v1/weights takes {"step": <int>} and, for the filesystem transport, "path"'
            )
        known = {"path", *(field for r in self.receivers for field in _fields(r))} - {"step"}
        unknown = set(body) - known - {"step"}
        if unknown:
            raise RequestError(
                sorted(unknown)[0],
                f"unknown field {sorted(unknown)[0]!r} (fields: {', '.join(['step', *sorted(known)])})",
            )
        extra = tuple(sorted(set(body) - {"step"}))
        with self._lock:
            try:
                if extra:  # a sync named by the request (a directory, say) is refused before anything is read
                    self._check_step(body["step"])
                tensors = self._fetch(body, extra)
                # a received sync is taken off the wire first, so the sender is not left waiting
                self._check_step(body["step"])
                bad = first_non_finite(tensors)
                if bad is not None:
                    raise RequestError(
                        "weights",
                        f"tensor {bad!r} of step {body['step']} holds NaN or infinite values; nothing was applied",
                        status=409,
                        code="non_finite_weights",
                    )
                applied = self.between_batches(lambda model: apply_weights(self.loaded.resolved, tensors)).result(
                    self.timeout_s
                )
            except LayoutMismatchError as exc:
                raise RequestError(
                    "weights", f"the weights do not fit the served model, nothing was applied: {exc}", status=409
                ) from None
            except BroadcastError as exc:
                raise RequestError("weights", str(exc), status=503, kind="server_error") from None
            self.step = body["step"]
        return {"object": "weights", "step": self.step, "tensors": applied}

    def _check_step(self, step: int) -> None:
        if self.step is not None and step < self.step:
            raise RequestError(
                "step",
                f"step {step} is older than step {self.step}, the last one applied; steps only move forward "
                "(the same step again is taken); nothing was applied",
                status=409,
                code="stale_step",
            )

    def _receiver_for(self, fields: tuple[str, ...]) -> Any:
        return next((r for r in self.receivers if tuple(sorted(_fields(r))) == fields), None)

    def _fetch(self, body: dict[str, Any], extra: tuple[str, ...]) -> Mapping[str, torch.Tensor]:
        receiver = self._receiver_for(extra)
        if receiver is None and not self.joined.is_set():
            self.joined.wait(self.timeout_s)  # the trainer may ask before this server's join has returned
            receiver = self._receiver_for(extra)
        if receiver is None:
            if not extra:
                raise RequestError(
                    "step",
                    "this server joined no weight process group; start it with --weights-from HOST:PORT, or send a "
                    "path",
                    status=409,
                )
            if extra == ("path",):
                if not isinstance(body["path"], str) or not body["path"]:
                    raise RequestError("path", '"path" must be a non-empty string naming a weights directory')
                raise RequestError(
                    "path",
                    "this server takes no weights directories: start it with --weights-dir DIR (the directory the "
                    "trainer's filesystem transport writes to)",
                    status=403,
                    kind="permission_error",
                    code="path_not_allowed",
                )
            raise RequestError(
                extra[0],
                f"this server takes no weights sent with {', '.join(extra)}: start it with the transport that sends "
                "them (--weights-transport NAME)",
                status=409,
            )
        return receiver.receive(timeout_s=self.timeout_s, **{field: body[field] for field in extra})


def _fields(receiver: Any) -> tuple[str, ...]:
    """The body fields besides ``step`` a receiver reads (none: bare ``{"step": N}`` bodies)."""
    return tuple(getattr(receiver, "fields", ()))
