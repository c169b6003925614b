"""vlmreg's weight syncs inside vLLM (``pip install vlmreg[vllm]``; verified with vLLM 0.24.0).

`vlmreg train` with ``[rollout] server = "vllm"`` and ``launch = true`` starts vLLM with everything below; to
start it yourself:

    VLLM_SERVER_DEV_MODE=1 vllm serve /path/to/checkpoint \\
        --worker-extension-cls vlmreg.integrations.vllm.VlmregWorkerExtension \\
        --weight-transfer-config '{"backend": "vlmreg"}' \\
        --logprobs-mode processed_logprobs --generation-config vllm

Importing this module in a vLLM worker (``--worker-extension-cls`` does) registers the weight-transfer engine
``"vlmreg"`` with vLLM's own weight-transfer API, so the trainer drives each sync through vLLM's endpoints:
``/init_weight_transfer_engine`` once, then per sync ``/start_weight_update`` (vLLM prepares a layerwise
reload), ``/update_weights`` (each worker takes the tensors, under checkpoint names, through the model's
``load_weights``), ``/finish_weight_update`` (vLLM finalizes: quantized layers are processed again) and
``/reset_prefix_cache`` plus ``/reset_encoder_cache`` (no KV or image embedding computed with the old weights
survives). A vLLM without that API is driven through ``/collective_rpc`` and `VlmregWorkerExtension` instead,
which loads the tensors the same way but cannot finalize.

Transports, named in the trainer's ``[broadcast] transport`` (the registered transports that declare ``vllm=True``;
the config refuses the others with ``server = "vllm"``, and the GPU placement each declares):

- ``"ipc"``: the trainer and vLLM share one GPU; each worker maps the trainer's tensors by CUDA IPC
  (`vlmreg.broadcast.ipc`) and copies them into its weights. The message is JSON, never a pickle.
- ``"nccl"`` / ``"gloo"``: the trainer's `Sender` broadcasts buckets over a private process group; each worker
  joins it as rank ``1 + its global rank`` (data-parallel index x tensor/pipeline world size + rank), so every
  worker of a tensor-parallel server receives every tensor and its ``load_weights`` keeps its own shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["TRANSFER_BACKEND", "VlmregWorkerExtension", "WeightIntake", "register_transfer_engine"]

TRANSFER_BACKEND = "vlmreg"
TRANSPORTS = ("ipc", "nccl", "gloo")

LoadWeights = Callable[[list[tuple[str, Any]]], Any]


class WeightIntake:
    """One inference worker's side of vlmreg's syncs, independent of vLLM's classes.

    ``rank``: this worker's global rank among the engine's workers (0-based); ``device``: its GPU (``None`` on CPU).
    """

    def __init__(self, rank: int, device: Any = None) -> None:
        self.rank, self.device = rank, device
        self.transport: str | None = None
        self._receiver: Any = None
        self._ipc: Any = None

    def init(self, info: dict[str, Any]) -> int:
        """Join the trainer's sync: ``{"transport", "host", "port", "timeout_s", "token"}`` (``token``: the sender's
        secret, which the weight group's store requires); returns the weight-group rank."""
        transport = info.get("transport")
        if transport not in TRANSPORTS:
            raise ValueError(f"vlmreg weight transfer: unknown transport {transport!r} (one of {', '.join(TRANSPORTS)})")
        self.close()
        self.transport = transport
        if transport == "ipc":
            from vlmreg.broadcast.ipc import IpcReceiver

            self._ipc = IpcReceiver(self.device)
            return 0
        from vlmreg.broadcast import Receiver

        rank = 1 + self.rank
        device = self.device if transport == "nccl" else "cpu"
        self._receiver = Receiver(
            None, host=str(info["host"]), port=int(info["port"]), rank=rank, backend=transport, device=device,
            timeout_s=float(info.get("timeout_s", 120.0)), token=info.get("token") or None,
        )
        return rank

    def receive(self, update: dict[str, Any], load_weights: LoadWeights) -> int:
        """Take one sync and hand its (checkpoint name, tensor) pairs to ``load_weights``; returns the count."""
        if self.transport is None:
            raise RuntimeError("vlmreg weight transfer: the trainer has not initialised this worker's transfer")
        if self.transport == "ipc":
            pairs: Iterable[tuple[str, Any]] = list(self._ipc.open(update.get("ipc", {})))
        else:
            pairs = list(self._receiver.receive(timeout_s=update.get("timeout_s")).items())
        load_weights(list(pairs))
        if self.device is not None and getattr(self.device, "type", "cuda") == "cuda":
            import torch

            torch.cuda.current_stream().synchronize()  # the trainer may change its weights once this returns
        return len(pairs)  # type: ignore[arg-type]

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        if self._ipc is not None:
            self._ipc.close()
        self._receiver = self._ipc = None


def _worker_rank(parallel_config: Any) -> int:
    """A worker's global rank, as vLLM's own NCCL weight transfer computes it."""
    return int(parallel_config.data_parallel_index) * int(parallel_config.world_size) + int(parallel_config.rank)


def register_transfer_engine() -> bool:
    """Register ``"vlmreg"`` with vLLM's weight-transfer engines; ``False`` when this vLLM has no such API."""
    try:
        from vllm.distributed.weight_transfer.base import (
            WeightTransferEngine,
            WeightTransferInitInfo,
            WeightTransferUpdateInfo,
        )
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    if TRANSFER_BACKEND in WeightTransferEngineFactory._registry:
        return True
    import dataclasses

    @dataclasses.dataclass
    class InitInfo(WeightTransferInitInfo):
        transport: str
        host: str = "127.0.0.1"
        port: int = 0
        timeout_s: float = 120.0
        token: str = ""

    @dataclasses.dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        step: int = 0
        ipc: dict | None = None
        timeout_s: float | None = None

    class VlmregTransferEngine(WeightTransferEngine):
        """vLLM's side of vlmreg's syncs: a `WeightIntake` per worker."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo

        def __init__(self, config: Any, parallel_config: Any, model: Any) -> None:
            super().__init__(config, parallel_config, model)
            import torch

            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            self.intake = WeightIntake(_worker_rank(parallel_config), device)

        def init_transfer_engine(self, init_info: Any) -> None:
            self.intake.init(dataclasses.asdict(init_info))

        def receive_weights(self, update_info: Any, load_weights: Any) -> None:
            self.intake.receive({"ipc": update_info.ipc, "timeout_s": update_info.timeout_s}, load_weights)

        def shutdown(self) -> None:
            self.intake.close()

        @staticmethod
        def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
            raise NotImplementedError("the trainer sends with vlmreg.train.vllm_server, not through vLLM")

    WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, VlmregTransferEngine)
    return True


class VlmregWorkerExtension:
    """Mixed into each vLLM worker by ``--worker-extension-cls``; ``self`` is the worker.

    Its methods are the fallback for a vLLM without the weight-transfer API, called through ``/collective_rpc``.
    """

    _vlmreg_intake: WeightIntake | None = None

    def _vlmreg_rank(self) -> int:
        config = getattr(self, "parallel_config", None) or getattr(getattr(self, "vllm_config", None), "parallel_config", None)
        return _worker_rank(config) if config is not None else int(getattr(self, "rank", 0))

    def vlmreg_join_weight_group(self, host: str, port: int, backend: str = "nccl", timeout_s: float = 120.0, token: str = "") -> int:
        """Join the trainer's sync at ``host:port`` (``backend``: nccl, gloo or ipc; ``token``: the sender's secret);
        returns this worker's rank there."""
        self._vlmreg_intake = WeightIntake(self._vlmreg_rank(), getattr(self, "device", None))
        return self._vlmreg_intake.init(
            {"transport": backend, "host": host, "port": int(port), "timeout_s": float(timeout_s), "token": str(token)}
        )

    def vlmreg_receive_weights(self, step: int, ipc: Any = None) -> int:
        """Receive one sync and load it with the model's ``load_weights``; returns how many tensors were loaded."""
        if self._vlmreg_intake is None:
            raise RuntimeError("vlmreg_join_weight_group has not been called on this worker")
        if isinstance(ipc, str):  # collective_rpc passes strings: the IPC message arrives as JSON text
            import json

            ipc = json.loads(ipc)
        model = self.model_runner.model  # type: ignore[attr-defined]
        return self._vlmreg_intake.receive({"ipc": ipc}, lambda pairs: model.load_weights(weights=pairs))


register_transfer_engine()
