"""`Transport`: a way to send trained weights to a rollout server, registered through ``vlmreg_register_transports``.

``[broadcast] transport`` names one (``"none"``, the default, sends nothing: the engine runs in the trainer). A
transport has two ends, each a factory called when a run needs it:

- ``sender(context)``, in the trainer: ``context`` is a `SenderContext` (the transport's name, the resolved family,
  device, ``[broadcast]`` section, output directory, server URL, log). It returns an object with ``server_args() ->
  (argv, env)`` (what a launched ``vlmreg serve`` needs to take its syncs), ``connect(timeout_s, *, launched)``,
  ``send(step, *, full, request) -> SyncStats | None`` and ``close()`` (`vlmreg.broadcast.senders` says more).
- ``receiver(context)``, in ``vlmreg serve``: ``context`` is a `ReceiverContext` (the loaded model, the options
  given with ``--weights-option KEY=VALUE``, the timeout). It returns an object with ``fields`` (the ``POST
  /v1/weights`` body fields it reads besides ``step``) and ``receive(timeout_s=..., **fields) -> {checkpoint name:
  tensor}`` (`vlmreg.serve.receivers` says more). ``None``: the transport does not work with ``vlmreg serve``.
- ``vllm_receiver(context)``, in each vLLM worker (vlmreg's weight-transfer engine, `vlmreg.inference.vllm_worker`):
  ``context`` is a `WorkerContext` (the worker's rank and device, and what the sender's ``worker_info()`` returned).
  It returns an object with ``receive(*, step, timeout_s, **fields)`` (the fields the sender passed to ``request``)
  giving ``(checkpoint name, tensor)`` pairs, which the worker hands to vLLM's ``load_weights``, and ``close()``
  (`vlmreg.broadcast.worker_receivers` has the built-in ones). A transport with one is for ``rollout.server =
  "vllm"``; its sender also has ``worker_info() -> dict`` (JSON: what every worker needs to join, sent once).

Its declared properties drive the config checks: which servers it works with (``receiver`` for ``vlmreg serve``,
``vllm_receiver`` for vLLM), where the server's GPU must be (``gpu``), and whether the server joins a process group
the trainer hosts (``process_group``: an attached server then needs a fixed port). Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import attrs

from vlmreg.sdk.field_checks import check_bool, check_callable, check_name, field_error

__all__ = ["GPU_PLACEMENTS", "NO_TRANSPORT", "ReceiverContext", "SenderContext", "Transport", "WorkerContext"]

#: ``[broadcast] transport`` value that sends nothing (an engine in the trainer); no transport may take the name.
NO_TRANSPORT = "none"
#: ``any``: the server may be anywhere; ``same``: it must share the trainer's GPU (CUDA IPC); ``separate``: it must
#: have a GPU of its own (NCCL: one GPU per rank).
GPU_PLACEMENTS = ("any", "same", "separate")


def _check_transport_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_name(instance, attribute, value)
    if value == NO_TRANSPORT:
        raise field_error(
            instance,
            attribute,
            f"may not be {NO_TRANSPORT!r}: [broadcast] transport = {NO_TRANSPORT!r} means no transport",
            value,
        )


def _check_gpu(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in GPU_PLACEMENTS:
        raise field_error(instance, attribute, f"must be one of {', '.join(repr(p) for p in GPU_PLACEMENTS)}", value)


@attrs.frozen(kw_only=True, eq=False)
class Transport:
    """A weight transport: its two ends and what it works with.

    ``sender(context) -> sender`` runs in the trainer; ``receiver(context) -> receiver`` in ``vlmreg serve`` (``None``:
    not for ``vlmreg serve``); ``vllm_receiver(context) -> receiver`` in each vLLM worker (``None``: not for vLLM);
    ``gpu``: ``"same"`` (server on the trainer's GPU only), ``"separate"`` (never on it) or ``"any"``;
    ``process_group``: the server joins a group the trainer hosts at ``[broadcast] host:port``.
    """

    name: str = attrs.field(validator=_check_transport_name)
    sender: Callable[[Any], Any] = attrs.field(
        validator=check_callable(optional=False, what="a callable taking a SenderContext")
    )
    receiver: Callable[[Any], Any] | None = attrs.field(
        default=None, validator=check_callable(optional=True, what="a callable taking a ReceiverContext")
    )
    vllm_receiver: Callable[[Any], Any] | None = attrs.field(
        default=None, validator=check_callable(optional=True, what="a callable taking a WorkerContext")
    )
    gpu: Literal["any", "same", "separate"] = attrs.field(default="any", validator=_check_gpu)
    process_group: bool = attrs.field(default=False, validator=check_bool)
    description: str = ""

    @property
    def vllm(self) -> bool:
        """Whether vLLM's workers can take it (it has a ``vllm_receiver``)."""
        return self.vllm_receiver is not None

    @property
    def servers(self) -> list[str]:
        """The ``[rollout] server`` values it works with."""
        return [server for server, ok in (("vlmreg", self.receiver is not None), ("vllm", self.vllm)) if ok]


@attrs.frozen(kw_only=True)
class SenderContext:
    """What a transport's ``sender`` gets, in the trainer: its ``name``, the ``resolved`` family (the model being
    trained), ``device``, the run's ``broadcast`` section, ``output_dir``, the server's ``url`` (``None`` until a
    launched one is up), ``log`` (one line at a time), ``num_receivers`` (the server's workers) and ``lora_modules``
    (adapter syncs: the adapted modules whose LoRA travels as adapters, to pass to `WeightPlan.from_resolved`; ``None``:
    LoRA, if any, merged; ``lora_base``: whether the full sync carries those modules' frozen base weights;
    ``lora_dtype``: the torch dtype their factors travel in, ``None``: their own)."""

    name: str
    resolved: Any
    device: Any
    broadcast: Any
    output_dir: Any
    url: str | None = None
    log: Callable[[str], None] = print
    num_receivers: int = 1
    lora_modules: frozenset[str] | None = None
    lora_base: bool = True
    lora_dtype: Any = None


@attrs.frozen(kw_only=True)
class ReceiverContext:
    """What a transport's ``receiver`` gets, in ``vlmreg serve``: the served model (``loaded``, a
    `vlmreg.loading.LoadedModel`), the ``options`` its sender asked for (``--weights-option KEY=VALUE``, strings) and
    ``timeout_s`` (``--weights-timeout``)."""

    loaded: Any
    options: dict[str, str] = attrs.field(factory=dict)
    timeout_s: float = 120.0


@attrs.frozen(kw_only=True)
class WorkerContext:
    """What a transport's ``vllm_receiver`` gets, in a vLLM worker: its ``name``, the worker's global ``rank`` among
    the engine's workers (0-based; tensor-parallel workers each take every tensor and keep their shard), its ``device``
    (a torch device, ``None`` on CPU), ``info`` (the sender's ``worker_info()``, as sent) and ``timeout_s``."""

    name: str
    rank: int
    device: Any
    info: dict[str, Any] = attrs.field(factory=dict)
    timeout_s: float = 120.0
