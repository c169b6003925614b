"""Errors of the weight broadcaster; all are `VlmregError`, so the CLI prints them as one line."""

from __future__ import annotations

from vlmreg.sdk.errors import VlmregError

__all__ = ["BroadcastError", "LayoutMismatchError", "ReceiverGaveUp", "SenderClosed"]


class BroadcastError(VlmregError):
    """A sync could not happen: a receiver is missing or stalled, a transfer failed, a checksum differs."""


class LayoutMismatchError(BroadcastError, ValueError):
    """The sender's tensors do not fit the receiver's model; raised before anything is applied."""


class SenderClosed(BroadcastError):
    """The sender closed the channel; a receiver waiting for the next sync gets this instead of a hang."""


class ReceiverGaveUp(BroadcastError):
    """A receiver said it gave up (it posted an abort), or said hello and then never joined: waiting longer will not
    help."""
