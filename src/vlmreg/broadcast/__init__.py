"""Weight broadcast from the trainer to inference engines that run apart, resolved from the family.

`WeightPlan` says what is sent (checkpoint names, LoRA merged); `Layout` packs it into a few large buckets;
`Sender` / `Receiver` move it over a private NCCL or gloo process group; `FilesystemSender` /
`FilesystemReader` publish it as atomic checkpoint directories; `apply_weights` puts it into a model.
See docs/broadcast.md.
"""

from vlmreg.broadcast.buckets import Layout, bucket_checksum
from vlmreg.broadcast.errors import BroadcastError, LayoutMismatchError, ReceiverGaveUp, SenderClosed
from vlmreg.broadcast.filesystem import FilesystemReader, FilesystemSender
from vlmreg.broadcast.plan import WeightPlan, apply_weights
from vlmreg.broadcast.transport import Receiver, Sender, SyncStats

__all__ = [
    "BroadcastError",
    "FilesystemReader",
    "FilesystemSender",
    "Layout",
    "LayoutMismatchError",
    "ReceiverGaveUp",
    "Receiver",
    "Sender",
    "SenderClosed",
    "SyncStats",
    "WeightPlan",
    "apply_weights",
    "bucket_checksum",
]
