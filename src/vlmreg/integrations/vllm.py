"""A vLLM worker extension that takes vlmreg's weight syncs (``pip install vlmreg[vllm]``).

Start vLLM with it, and with logprobs of the distribution it samples from:

    VLLM_SERVER_DEV_MODE=1 vllm serve /path/to/checkpoint \\
        --worker-extension-cls vlmreg.integrations.vllm.VlmregWorkerExtension \\
        --logprobs-mode processed_logprobs --generation-config vllm

then train with ``[rollout] engine = "openai"``, ``server = "vllm"``, ``url = "http://HOST:8000"`` and
``[broadcast] transport = "nccl"``, a fixed ``port``. The trainer calls, through vLLM's ``/collective_rpc``:
``vlmreg_join_weight_group(host, port, backend, timeout_s)`` once, then ``vlmreg_receive_weights(step)``
after every optimizer step; each worker receives the buckets and hands the tensors, under their checkpoint
names, to the model's own ``load_weights``, which maps them onto vLLM's fused layers.

Status: written against vLLM's documented worker-extension interface (methods mixed into the worker,
``self.model_runner.model.load_weights(weights=...)``, ``collective_rpc``); tested here with a stand-in
worker over a real gloo process group (tests/integrations/test_vllm_extension.py); not yet run against a
real vLLM (none can be installed in this project's CPU sandbox or on its GPU machine). One worker per server
(tensor parallel size 1) is assumed: its rank in the weight group is 1.
"""

from __future__ import annotations

from typing import Any

__all__ = ["VlmregWorkerExtension"]


class VlmregWorkerExtension:
    """Mixed into each vLLM worker by ``--worker-extension-cls``; ``self`` is the worker."""

    _vlmreg_receiver: Any = None

    def vlmreg_join_weight_group(self, host: str, port: int, backend: str = "nccl", timeout_s: float = 120.0) -> int:
        """Join the trainer's weight process group (its sender's store at ``host:port``); returns this rank."""
        from vlmreg.broadcast import Receiver

        device = getattr(self, "device", None) if backend == "nccl" else "cpu"
        self._vlmreg_receiver = Receiver(None, host=host, port=port, rank=1, backend=backend, device=device, timeout_s=timeout_s)
        return 1

    def vlmreg_receive_weights(self, step: int) -> int:
        """Receive one sync and load it with the model's ``load_weights``; returns how many tensors were loaded."""
        if self._vlmreg_receiver is None:
            raise RuntimeError("vlmreg_join_weight_group has not been called on this worker")
        tensors = self._vlmreg_receiver.receive()
        self.model_runner.model.load_weights(weights=list(tensors.items()))
        return len(tensors)
