"""vlmreg's weight syncs inside vLLM (``pip install vlmreg[vllm]``; verified with vLLM 0.24.0).

`vlmreg train` with ``[rollout] server = "vllm"`` and ``launch = true`` starts vLLM with everything below; to
start it yourself:

    VLLM_SERVER_DEV_MODE=1 vllm serve /path/to/checkpoint \\
        --worker-extension-cls vlmreg.inference.vllm_worker.VlmregWorkerExtension \\
        --weight-transfer-config '{"backend": "vlmreg"}' \\
        --logprobs-mode processed_logprobs --generation-config vllm

Importing this module in a vLLM worker (``--worker-extension-cls`` does) registers the weight-transfer engine
``"vlmreg"`` with vLLM's own weight-transfer API, so the trainer drives each sync through vLLM's endpoints:
``/init_weight_transfer_engine`` once, then per sync ``/start_weight_update`` (vLLM prepares a layerwise
reload), ``/update_weights`` (each worker takes the tensors, under checkpoint names, through the model's
``load_weights``), ``/finish_weight_update`` (vLLM finalizes: quantized layers are processed again); no KV or image
embedding of the old weights is reused after it (`vlmreg.inference.cache_scope`, or cache resets for an engine that
does not scope its requests). A vLLM without that API is driven through ``/collective_rpc`` and `VlmregWorkerExtension`
instead, which loads the tensors the same way but cannot finalize.

Transports, named in the trainer's ``[broadcast] transport``: any registered transport with a ``vllm_receiver``
(`vlmreg.sdk.transport`), a plugin's as well as the built-ins; each worker builds that end from the registry of its
own environment, so a plugin transport must be installed where vLLM runs. The built-ins:

- ``"ipc"``: the trainer and vLLM share one GPU; each worker maps the trainer's tensors by CUDA IPC
  (`vlmreg.broadcast.ipc`) and copies them into its weights. The message is JSON, never a pickle.
- ``"nccl"`` / ``"gloo"``: the trainer's `Sender` broadcasts buckets over a private process group; each worker
  joins it as rank ``1 + its global rank`` (data-parallel index x tensor/pipeline world size + rank), so every
  worker of a tensor-parallel server receives every tensor and its ``load_weights`` keeps its own shard.

Copy plans: a worker that sees the same tensors at the same addresses sync after sync (CUDA IPC views of the
trainer's parameters) records, on the second such sync, the copies ``load_weights`` makes, and replays them from then
on as one grouped copy (`vlmreg.broadcast.copy_plan`: strict, refused with a logged reason when the loader does
anything a replay would miss). ``VLMREG_COPY_PLAN=0`` in vLLM's environment turns it off. The first syncs log their
receive and load times to vLLM's log. A trainer on the worker's GPU may ask for the plan
(``vlmreg_export_copy_plan``, with CUDA IPC handles of the weights it writes) and replay it itself
(``[broadcast] vllm_push``).

What the trainer sends: once, ``{"transport", "timeout_s", "info"}`` (``info``: its sender's ``worker_info()``); per
sync, ``{"step", "timeout_s", "fields"}`` (``fields``: what its sender passed to ``request``, and ``lora_path`` and
``lora_mode`` with adapter syncs).

Adapter syncs (LoRA, ``vllm serve --enable-lora``): the trainer asks each worker once which of its adapted modules
vLLM serves as LoRA (``vlmreg_lora_modules``); per sync, the factors of those travel under peft's names with the
rest, and the worker hands them to vLLM's LoRA manager for the adapter directory ``lora_path`` instead of loading them
as weights (``lora_mode``: `vlmreg.inference.vllm_lora.take_adapter`): staged for the trainer's next
``/v1/load_lora_adapter``, or written into the live adapter in place (`vlmreg.inference.vllm_lora_live`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

from vlmreg.inference.vllm_lora import install, served_modules, take_adapter
from vlmreg.sdk.registry import get_transport_registry
from vlmreg.sdk.transport import WorkerContext

__all__ = ["COPY_PLAN_ENV", "TRANSFER_BACKEND", "VlmregWorkerExtension", "WeightIntake", "register_transfer_engine"]

TRANSFER_BACKEND = "vlmreg"
#: Set to ``0`` in vLLM's environment to load every sync through ``load_weights`` (no copy plans).
COPY_PLAN_ENV = "VLMREG_COPY_PLAN"
#: The first syncs of a worker log their receive and load times (to the engine's log).
TIMED_SYNCS = 8

LoadWeights = Callable[[list[tuple[str, Any]]], Any]


class WeightIntake:
    """One inference worker's side of vlmreg's syncs, independent of vLLM's classes.

    ``rank``: this worker's global rank among the engine's workers (0-based); ``device``: its GPU (``None`` on CPU).
    """

    def __init__(self, rank: int, device: Any = None, model: Any = None) -> None:
        self.rank, self.device, self.model = rank, device, model
        self.transport: str | None = None
        self._receiver: Any = None
        self.loads: Any = None  # `vlmreg.broadcast.copy_plan.PlannedLoads` when syncs may be replayed as copy plans
        self.syncs = 0
        self._told: set[str] = set()
        self._last: tuple[int, list[tuple[str, Any]]] | None = None  # the last sync's step and pairs (weakly held)
        self._bucket_replay: tuple[Any, tuple, Any] | None = None  # (plan, bucket ranges, BucketReplay or None)

    def init(self, message: dict[str, Any]) -> None:
        """Join the trainer's sync: ``{"transport", "timeout_s", "info"}``; the transport's ``vllm_receiver`` is
        looked up in this process's registry (plugins included) and built with a `WorkerContext`."""

        name = message.get("transport")
        registry = get_transport_registry()
        if not isinstance(name, str) or name not in registry.names():
            raise ValueError(
                f"vlmreg weight transfer: transport {name!r} is not registered in this vLLM's environment "
                f"(registered: {', '.join(registry.names()) or 'none'}); install its plugin where vLLM runs"
            )
        spec = registry.get(name)
        if spec.vllm_receiver is None:
            raise ValueError(
                f"vlmreg weight transfer: transport {name!r} has no vLLM end (its Transport declares no vllm_receiver)"
            )
        self.close()
        context = WorkerContext(
            name=name,
            rank=self.rank,
            device=self.device,
            info=dict(message.get("info") or {}),
            timeout_s=float(message.get("timeout_s") or 120.0),
        )
        self._receiver = spec.vllm_receiver(context)
        self.transport = name

    def receive(self, update: dict[str, Any], load_weights: LoadWeights) -> int:
        """Take one sync (``{"step", "timeout_s", "fields"}``) and hand its (checkpoint name, tensor) pairs to
        ``load_weights`` (or replay its recorded copy plan, bucket by bucket as they arrive); returns the count.

        Once the weights are written (the device synchronized), a receiver that can confirm (`Receiver.confirm`) tells
        the trainer so, with this sync's timings, before vLLM's answer is on its way."""
        if self._receiver is None:
            raise RuntimeError("vlmreg weight transfer: the trainer has not initialised this worker's transfer")
        # deferred: start-up cost (loads torch)
        from vlmreg.broadcast.bucket_replay import SyncClock  # noqa: PLC0415

        started, step = time.perf_counter(), int(update.get("step", 0))
        fields = dict(update.get("fields") or {})
        lora_path, lora_mode = fields.pop("lora_path", None), fields.pop("lora_mode", None)
        clock = SyncClock(self.device)
        begin = getattr(self._receiver, "begin", None)
        if callable(begin) and lora_path is None:  # the buckets' receives posted: copy behind them as they arrive
            incoming = begin(step=step, timeout_s=update.get("timeout_s"), **fields)
            header = time.perf_counter()
            clock.mark("header")
            count = len(incoming.tensors)
            pairs, how, pipelined = self._take(incoming, load_weights, clock)
        else:
            pairs = list(self._receiver.receive(step=step, timeout_s=update.get("timeout_s"), **fields))
            header, count = time.perf_counter(), len(pairs)
            for mark in ("header", "arrived"):
                clock.mark(mark)
            pairs, how = self._load(pairs, load_weights, lora_path, lora_mode)
            clock.mark("applied")
            pipelined = 0
        if pairs and self.loads is not None:  # went through the copy plans: a trainer on this GPU may ask for the plan
            self._last = (step, [(name, weakref.ref(tensor)) for name, tensor in pairs])
        if self.device is not None and getattr(self.device, "type", "cuda") == "cuda":
            # deferred: start-up cost (loads torch)
            import torch  # noqa: PLC0415

            torch.cuda.current_stream().synchronize()  # the trainer may change its weights once this returns
        record = {
            "wait_s": header - started,  # until the trainer sent the sync's header (long when the trainer posted early)
            "receive_s": clock.seconds("header", "arrived"),
            "copy_s": (
                sum(clock.seconds(f"in{k}", f"out{k}") for k in range(pipelined))
                if pipelined
                else clock.seconds("arrived", "applied")
            ),
            "tail_s": clock.seconds("arrived", "applied"),
            "total_s": time.perf_counter() - header,
        }
        confirm = getattr(self._receiver, "confirm", None)
        if callable(confirm):
            confirm(record)
        self.syncs += 1
        if self.syncs <= TIMED_SYNCS:
            print(
                f"vlmreg worker {self.rank}: sync {self.syncs}: {count} tensors, {how}; waited "
                f"{1e3 * record['wait_s']:.1f} ms for the trainer, received in {1e3 * record['receive_s']:.2f} ms, "
                f"copies {1e3 * record['copy_s']:.2f} ms, {1e3 * record['tail_s']:.2f} ms of them after the last "
                f"byte; done {1e3 * record['total_s']:.2f} ms after the header",
                file=sys.stderr,
                flush=True,
            )
        return count

    def _take(self, incoming: Any, load_weights: LoadWeights, clock: Any) -> tuple[list, str, int]:
        """A sync whose buckets are arriving (`vlmreg.broadcast.receiver.Incoming`): its recorded copy plan replayed
        bucket by bucket behind the transfer when there is one (and no checksum must be checked first), else loaded once
        everything is in; the pairs, how, and how many buckets were replayed one by one (0: none)."""
        pairs = list(incoming.tensors.items())
        plan = self.loads.plan_for(self.model, pairs) if pairs and self._plannable() else None
        replay = self._bucketed(plan, incoming.ranges) if plan is not None and incoming.early else None
        if replay is None:
            incoming.finish()
            clock.mark("arrived")
            if plan is not None:
                plan.replay()
                self.loads.last = how = "replayed"
                self._tell(how)
            else:
                pairs, how = self._load(pairs, load_weights, None, None)
            clock.mark("applied")
            return pairs, how, 0
        last = len(incoming.buckets) - 1
        for index in range(last + 1):
            incoming.wait(index)
            clock.mark(f"in{index}")
            replay.run(index)
            clock.mark(f"out{index}")
        incoming.finish()
        clock.marks["arrived"], clock.marks["applied"] = clock.marks[f"in{last}"], clock.marks[f"out{last}"]
        self.loads.last = "replayed"
        self._tell("replayed")
        return pairs, f"replayed bucket by bucket ({last + 1} buckets)", last + 1

    def _bucketed(self, plan: Any, ranges: Any) -> Any:
        """The `BucketReplay` of ``plan`` over these buckets (kept while they stay), or ``None`` (logged once) when its
        copies cannot be sorted by bucket."""
        # deferred: start-up cost (loads torch)
        from vlmreg.broadcast.bucket_replay import BucketReplay  # noqa: PLC0415
        from vlmreg.broadcast.copy_plan import PlanRefused  # noqa: PLC0415

        cached = self._bucket_replay
        if cached is not None and cached[0] is plan and cached[1] == tuple(ranges):
            return cached[2]
        try:
            replay = BucketReplay(plan, ranges)
        except PlanRefused as exc:
            replay = None
            print(
                f"vlmreg worker {self.rank}: copies replayed after the whole sync: {exc}", file=sys.stderr, flush=True
            )
        self._bucket_replay = (plan, tuple(ranges), replay)
        return replay

    def _load(self, pairs: list, load_weights: LoadWeights, lora_path: Any, lora_mode: Any) -> tuple[list, str]:
        """Received pairs into the model: adapter factors to vLLM's LoRA manager for ``lora_path`` (``lora_mode``:
        `vlmreg.inference.vllm_lora.take_adapter`), the rest through the copy plans (or ``load_weights``); the pairs
        loaded and how."""
        how = "loaded"
        if lora_path is not None:  # adapter factors go to vLLM's LoRA manager (`take_adapter`), the rest are weights
            # deferred: start-up cost (loads torch)
            from vlmreg.broadcast.adapters import is_adapter_tensor  # noqa: PLC0415

            factors = [(n, t) for n, t in pairs if is_adapter_tensor(n)]
            taken = take_adapter(str(lora_path), lora_mode, factors, self.model, self.device)
            pairs = [(n, t) for n, t in pairs if not is_adapter_tensor(n)]
            how = f"{taken}, {len(pairs)} weights loaded"
        if pairs and self._plannable():
            how = self.loads.load(self.model, load_weights, pairs)
            self._tell(how)
        elif pairs:
            load_weights(pairs)
        return pairs, how

    def export_plan(self, step: int) -> dict[str, Any]:
        """The copy plan of this worker's last sync (of ``step``), for a trainer on the same GPU to replay itself
        (`vlmreg.broadcast.copy_plan.PushedPlan`): ``{"plan": ...}`` with the weights' CUDA IPC handles, or
        ``{"plan": None, "reason": ..., "final": bool}`` (``final``: asking again after later syncs will not help)."""
        # deferred: start-up cost (loads safetensors, torch)
        from vlmreg.broadcast.copy_plan import PlanRefused, incoming_key, model_key  # noqa: PLC0415

        if self.syncs == 0:
            return {"plan": None, "reason": "this worker has taken no sync yet", "final": False}
        if self.loads is None:
            return {"plan": None, "reason": "this worker loads without copy plans (VLMREG_COPY_PLAN=0?)", "final": True}
        if self._last is None or self._last[0] != step:
            return {"plan": None, "reason": f"this worker's last sync was not step {step}", "final": False}
        pairs = [(name, ref()) for name, ref in self._last[1]]
        if any(tensor is None for _, tensor in pairs):
            return {
                "plan": None,
                "reason": "the last sync's tensors are gone (the transport does not keep them)",
                "final": True,
            }
        key = incoming_key(pairs)
        plan = self.loads.plans.get(key)
        if plan is None:
            reason = self.loads.refused.get(key)
            return {
                "plan": None,
                "reason": reason or "no copy plan recorded for this layout yet",
                "final": reason is not None,
            }
        if plan.model_key != model_key(self.model):
            return {"plan": None, "reason": "the model's parameters moved since the plan was recorded", "final": True}
        if self.device is None or getattr(self.device, "type", "cuda") != "cuda":
            return {"plan": None, "reason": "this worker is not on a GPU", "final": True}
        # deferred: start-up cost (loads safetensors, torch)
        from vlmreg.broadcast.ipc import describe, gpu_uuid  # noqa: PLC0415

        try:
            exported = plan.export(pairs, describe)
        except (PlanRefused, RuntimeError, ValueError) as exc:
            return {"plan": None, "reason": f"the plan could not be shared: {exc}", "final": True}
        exported["gpu"] = gpu_uuid(self.device)

        print(
            f"vlmreg worker {self.rank}: copy plan of step {step} exported ({len(exported['copies'])} copies, "
            f"{len(exported['destinations'])} weight allocations shared)",
            file=sys.stderr,
            flush=True,
        )
        return {"plan": exported}

    def _plannable(self) -> bool:
        """Copy plans (`vlmreg.broadcast.copy_plan`) for a worker that holds a torch model, unless
        ``VLMREG_COPY_PLAN=0``; each sync is then checked to be replayable, and loaded plainly when it is not."""

        if self.model is None or os.environ.get(COPY_PLAN_ENV, "1") == "0":
            return False
        # deferred: start-up cost (loads torch)
        from torch import nn  # noqa: PLC0415

        while not isinstance(self.model, nn.Module) and callable(getattr(self.model, "unwrap", None)):
            self.model = self.model.unwrap()  # a CUDA-graph wrapper around the model
        if not isinstance(self.model, nn.Module):
            return False
        if self.loads is None:
            # deferred: start-up cost (loads safetensors, torch)
            from vlmreg.broadcast.copy_plan import PlannedLoads  # noqa: PLC0415

            self.loads = PlannedLoads()
        return True

    def _tell(self, how: str) -> None:
        """A line in the engine's log the first time a sync is recorded or replayed, and for each refused plan."""

        events = [how] if how in ("recorded", "replayed") else []
        events += [f"loaded with load_weights (no copy plan: {reason})" for reason in self.loads.refused.values()]
        for event in events:
            if event not in self._told:
                self._told.add(event)
                plans = list(self.loads.plans.values())
                detail = (
                    f": {len(plans[-1].copies)} copies, {plans[-1].bytes / 1e9:.2f} GB"
                    if plans and event == how
                    else ""
                )
                print(f"vlmreg worker {self.rank}: weight sync {event}{detail}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        self._receiver, self.transport = None, None


def _worker_rank(parallel_config: Any) -> int:
    """A worker's global rank, as vLLM's own NCCL weight transfer computes it."""
    return int(parallel_config.data_parallel_index) * int(parallel_config.world_size) + int(parallel_config.rank)


def register_transfer_engine() -> bool:
    """Register ``"vlmreg"`` with vLLM's weight-transfer engines; ``False`` when this vLLM has no such API."""
    try:
        # deferred: fails to import here (ModuleNotFoundError: No module named 'vllm')
        from vllm.distributed.weight_transfer.base import (  # noqa: PLC0415
            WeightTransferEngine,
            WeightTransferInitInfo,
            WeightTransferUpdateInfo,
        )
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: PLC0415
    except ImportError:
        return False
    if TRANSFER_BACKEND in WeightTransferEngineFactory._registry:
        return True

    @dataclasses.dataclass
    class InitInfo(WeightTransferInitInfo):
        transport: str
        timeout_s: float = 120.0
        info: dict = dataclasses.field(default_factory=dict)

    @dataclasses.dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        step: int = 0
        timeout_s: float | None = None
        fields: dict = dataclasses.field(default_factory=dict)

    class VlmregTransferEngine(WeightTransferEngine):
        """vLLM's side of vlmreg's syncs: a `WeightIntake` per worker."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo

        def __init__(self, config: Any, parallel_config: Any, model: Any) -> None:
            super().__init__(config, parallel_config, model)
            # deferred: start-up cost (loads torch)
            import torch  # noqa: PLC0415

            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            self.intake = WeightIntake(_worker_rank(parallel_config), device, model)

        def init_transfer_engine(self, init_info: Any) -> None:
            self.intake.init(dataclasses.asdict(init_info))

        def receive_weights(self, update_info: Any, load_weights: Any) -> None:
            self.intake.receive(
                {"step": update_info.step, "timeout_s": update_info.timeout_s, "fields": update_info.fields},
                load_weights,
            )

        def shutdown(self) -> None:
            self.intake.close()

        @staticmethod
        def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
            raise NotImplementedError("the trainer sends with vlmreg.inference.vllm_server, not through vLLM")

    WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, VlmregTransferEngine)
    return True


class VlmregWorkerExtension:
    """Mixed into each vLLM worker by ``--worker-extension-cls``; ``self`` is the worker.

    Its methods are the fallback for a vLLM without the weight-transfer API, called through ``/collective_rpc``.
    """

    _vlmreg_intake: WeightIntake | None = None

    def _vlmreg_rank(self) -> int:
        config = getattr(self, "parallel_config", None) or getattr(
            getattr(self, "vllm_config", None), "parallel_config", None
        )
        return _worker_rank(config) if config is not None else int(getattr(self, "rank", 0))

    def vlmreg_join_weight_group(self, message: str) -> int:
        """Join the trainer's sync (``message``: JSON ``{"transport", "timeout_s", "info"}``, as the weight-transfer
        API's init info); returns this worker's global rank."""

        runner: Any = getattr(self, "model_runner", None)
        # no CUDA-graph wrapper
        model = runner.get_model() if hasattr(runner, "get_model") else getattr(runner, "model", None)
        self._vlmreg_intake = WeightIntake(self._vlmreg_rank(), getattr(self, "device", None), model)
        self._vlmreg_intake.init(json.loads(message))
        return self._vlmreg_intake.rank

    def vlmreg_receive_weights(self, update: str) -> int:
        """Receive one sync (``update``: JSON ``{"step", "timeout_s", "fields"}``; collective_rpc passes strings) and
        load it with the model's ``load_weights``; returns how many tensors were loaded."""

        if self._vlmreg_intake is None:
            raise RuntimeError("vlmreg_join_weight_group has not been called on this worker")
        model = self.model_runner.model  # type: ignore[attr-defined]
        return self._vlmreg_intake.receive(json.loads(update), lambda pairs: model.load_weights(weights=pairs))

    def vlmreg_lora_modules(self, message: str) -> str:
        """Of the trainer's adapted modules (``message``: a JSON list of names), those this worker's vLLM serves as
        LoRA (none without ``--enable-lora``), and whether it keeps the adapter live: JSON ``{"served": [...],
        "live": bool}``; adapters staged by later syncs are then built from their tensors
        (`vlmreg.inference.vllm_lora`)."""
        manager = getattr(getattr(self, "model_runner", None), "lora_manager", None)
        if manager is None:
            return json.dumps({"served": [], "live": False})
        install(manager)
        # deferred: start-up cost (loads torch)
        from vlmreg.inference.vllm_lora_live import live_supported  # noqa: PLC0415

        served = served_modules(manager._adapter_manager, json.loads(message))
        return json.dumps({"served": served, "live": live_supported(manager._adapter_manager)})

    def vlmreg_export_copy_plan(self, step: int) -> str:
        """JSON of `WeightIntake.export_plan` for the sync of ``step`` just loaded: the trainer on this GPU replays
        the plan itself from then on (``[broadcast] vllm_push``)."""

        if self._vlmreg_intake is None:
            return json.dumps(
                {"plan": None, "reason": "vlmreg_join_weight_group has not been called on this worker", "final": True}
            )
        return json.dumps(self._vlmreg_intake.export_plan(int(step)))


register_transfer_engine()
