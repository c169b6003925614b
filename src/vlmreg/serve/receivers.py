"""The server's ends of vlmreg's built-in transports, in the shape every registered transport's receiver has.

A receiver (what ``Transport.receiver(context)`` returns) has ``fields``, the ``POST /v1/weights`` body fields it
reads besides ``step`` (none: it takes ``{"step": N}`` bodies), and ``receive(timeout_s=..., **fields) -> {checkpoint
name: tensor}``, which `vlmreg.serve.weights.WeightUpdates` calls for each body whose fields are exactly those. It
may raise `vlmreg.serve.protocol.RequestError` (the answer's status and message), `LayoutMismatchError` (409) or
`BroadcastError` (503); nothing is applied then. A ``close()`` is called when the server stops, if it has one.

- ``gloo`` / ``nccl``: a `vlmreg.broadcast.Receiver` in the trainer's process group (options ``host``, ``port``,
  ``rank``); takes ``{"step": N}``.
- ``filesystem``: `DirectoryReceiver` (option ``directory``); takes ``{"step": N, "path": DIR}``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vlmreg.broadcast import FilesystemReader, Receiver
from vlmreg.serve.protocol import RequestError
from vlmreg.serve.weights import required_tensors

__all__ = ["DirectoryReceiver", "directory_receiver", "group_receiver"]

_STEP_DIR = re.compile(r"^step_\d+$")


def group_receiver(ctx: Any, backend: str) -> Receiver:
    """Join the trainer's weight process group at ``host:port`` as ``rank`` (the options), checking the layouts."""
    options, loaded = ctx.options, ctx.loaded
    return Receiver(
        loaded.resolved,
        host=options["host"],
        port=int(options["port"]),
        rank=int(options.get("rank", 1)),
        backend=backend,
        device=loaded.device,
        timeout_s=ctx.timeout_s,
    )


def directory_receiver(ctx: Any) -> DirectoryReceiver:
    return DirectoryReceiver(ctx.loaded, ctx.options["directory"])


class DirectoryReceiver:
    """Loads ``step_NNNNNN`` directories written by the filesystem transport, only under ``weights_dir``."""

    fields = ("path",)

    def __init__(self, loaded: Any, weights_dir: str | Path) -> None:
        self.loaded, self.weights_dir = loaded, Path(weights_dir)

    def _directory(self, path: Any) -> Path:
        """``path`` resolved (symlinks too), once it is known to lie under ``weights_dir``; else the refusal."""
        if not isinstance(path, str) or not path:
            raise RequestError("path", '"path" must be a non-empty string naming a weights directory')
        root, target = self.weights_dir.resolve(), Path(path).resolve()
        if target == root or not target.is_relative_to(root):
            raise RequestError(
                "path",
                f"{path!r} is not under the server's --weights-dir {str(self.weights_dir)!r}",
                status=403,
                kind="permission_error",
                code="path_not_allowed",
            )
        if not _STEP_DIR.match(target.name):
            raise RequestError("path", f"{path!r} is not a step_NNNNNN directory written by the filesystem transport")
        if not FilesystemReader.is_complete(target):
            raise RequestError(
                "path", f"{path!r} is not a complete weights directory written by the filesystem transport"
            )
        return target

    def receive(self, timeout_s: float | None = None, *, path: Any) -> Mapping[str, Any]:
        directory = self._directory(path)
        try:
            _, tensors = FilesystemReader(directory.parent).load(directory, device=self.loaded.device)
        # a truncated or corrupt shard or index: safetensors' own error, OSError, ValueError...
        except Exception as exc:
            raise RequestError(
                "path",
                f"{path!r}: cannot read the weights, nothing was applied: {type(exc).__name__}: {exc}",
                status=409,
                code="unreadable_weights",
            ) from None
        missing = [name for name in required_tensors(self.loaded) if name not in tensors]
        if missing:
            raise RequestError(
                "path",
                f"{path!r} lacks tensor {missing[0]!r} of the served model ({len(missing)} missing); nothing was "
                "applied",
                status=409,
                code="incomplete_weights",
            )
        return tensors
