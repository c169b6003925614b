"""The vLLM worker extension over a real gloo process group, with a stand-in for vLLM's worker and model."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import sys

import torch

import vlmreg
from vlmreg.broadcast import Sender, WeightPlan
from vlmreg.config import parse_config
from vlmreg.integrations.vllm import VlmregWorkerExtension


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(port: int, queue, token: str) -> None:
    class Model:  # what vLLM's model offers the extension: load_weights over (checkpoint name, tensor) pairs
        def __init__(self):
            self.loaded: dict[str, torch.Tensor] = {}

        def load_weights(self, weights):
            for name, tensor in weights:
                self.loaded[name] = tensor.clone()

    class Worker(VlmregWorkerExtension):
        def __init__(self):
            self.model_runner = type("Runner", (), {"model": Model()})()

    worker = Worker()
    joined = {"transport": "gloo", "timeout_s": 60, "info": {"host": "127.0.0.1", "port": port, "token": token}}
    worker.vlmreg_join_weight_group(json.dumps(joined))
    counts = [worker.vlmreg_receive_weights(json.dumps({"step": step, "timeout_s": 60})) for step in (0, 1)]
    loaded = worker.model_runner.model.loaded
    queue.put((counts, {k: v.sum().item() for k, v in loaded.items()}))


def test_the_extension_loads_synced_weights_under_checkpoint_names():
    assert "vllm" not in sys.modules
    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}}))
    port = _port()
    sender = Sender(loaded.resolved, num_receivers=1, port=port, backend="gloo", timeout_s=60)
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_worker, args=(port, queue, sender.token))
    process.start()
    try:
        sender.connect()
        full = sender.send(0, full=True)
        with torch.no_grad():
            loaded.resolved.lm_head.weight.add_(1.0)
        step = sender.send(1)
        counts, sums = queue.get(timeout=60)
    finally:
        sender.close()
        process.join(30)
    assert counts == [full.tensors, step.tensors] and step.tensors < full.tensors
    expected = dict(WeightPlan.from_resolved(loaded.resolved, include_frozen_vision=True).tensors())
    assert set(sums) == set(expected)
    assert sums["lm_head.weight"] == expected["lm_head.weight"].sum().item()
