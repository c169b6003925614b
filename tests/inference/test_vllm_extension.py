"""The vLLM worker extension over a real gloo process group, with a stand-in for vLLM's worker and model."""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import socket
import sys

import torch
from safetensors.torch import load_file

import vlmreg
from vlmreg.broadcast import Sender, WeightPlan
from vlmreg.broadcast.plan import lora_modules
from vlmreg.config import parse_config
from vlmreg.inference import vllm_lora
from vlmreg.inference.vllm_worker import VlmregWorkerExtension


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
    loaded = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}})
    )
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


def _lora_worker(port: int, queue, token: str, lora_path: str) -> None:
    class Model:
        def __init__(self):
            self.loads: list[dict[str, torch.Tensor]] = []

        def load_weights(self, weights):
            self.loads.append({name: tensor.clone() for name, tensor in weights})

    class Worker(VlmregWorkerExtension):
        def __init__(self):
            self.model_runner = type("Runner", (), {"model": Model()})()

    worker = Worker()
    joined = {"transport": "gloo", "timeout_s": 60, "info": {"host": "127.0.0.1", "port": port, "token": token}}
    worker.vlmreg_join_weight_group(json.dumps(joined))
    staged = []
    for step in (0, 1):
        worker.vlmreg_receive_weights(json.dumps({"step": step, "timeout_s": 60, "fields": {"lora_path": lora_path}}))
        staged.append({path: {n: t.numpy() for n, t in tensors.items()} for path, tensors in vllm_lora.STAGED.items()})
    loads = [{n: t.numpy() for n, t in load.items()} for load in worker.model_runner.model.loads]
    queue.put((loads, staged))  # numpy arrays: torch tensors would be shared memory gone with this process


def test_adapter_syncs_stage_the_factors_vllm_serves_and_load_the_rest_merged(tmp_path):
    """A worker told ``lora_path`` keeps the adapter factors of the modules vLLM serves (here: the language model's)
    for that directory, exactly peft's own adapter file, and loads only the merged vision weights (peft's own
    ``merge_and_unload``); the frozen base of the served modules is never sent (vLLM keeps its checkpoint's)."""

    loaded = vlmreg.load(
        parse_config(
            {
                "model": {
                    "init": "random",
                    "family": "qwen3_vl",
                    "lora": {"r": 4, "alpha": 8, "targets": "all-linear"},
                    "vlm": {"freeze_vision_encoder": False},
                },
                "trainer": {"device": "cpu"},
            }
        )
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in loaded.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    _, keepable = lora_modules(loaded.resolved)
    language = frozenset(name for name in keepable if name.startswith("model.language_model."))
    assert language and len(language) < len(keepable)
    port = _port()
    sender = Sender(
        loaded.resolved,
        num_receivers=1,
        port=port,
        backend="gloo",
        timeout_s=60,
        lora_modules=language,
        lora_base=False,
    )
    context = mp.get_context("spawn")
    queue = context.Queue()
    adapter_dir = tmp_path / "adapter"
    process = context.Process(target=_lora_worker, args=(port, queue, sender.token, str(adapter_dir)))
    process.start()
    try:
        sender.connect()
        sender.send(0, full=True)
        sender.send(1)
        loads, staged = queue.get(timeout=60)
    finally:
        sender.close()
        process.join(30)
    loaded.model.save_pretrained(tmp_path)  # peft's own adapter file: the reference for the factors
    peft_file = load_file(tmp_path / "adapter_model.safetensors")
    expected = {name: t for name, t in peft_file.items() if name.startswith("base_model.model.model.language_model.")}
    for sync in staged:
        assert list(sync) == [os.path.realpath(adapter_dir)]
        factors = sync[os.path.realpath(adapter_dir)]
        assert factors.keys() == expected.keys()
        assert all(torch.equal(torch.from_numpy(factors[name]), expected[name]) for name in expected)
    merged = copy.deepcopy(loaded.model).merge_and_unload().state_dict()  # peft's own merge: the reference for the rest
    full, step = loads
    assert not any(name.startswith(tuple(m + "." for m in language)) for name in full)  # vLLM keeps its own base there
    assert all(name.startswith("model.visual.") for name in step) and step
    for name, tensor in step.items():
        torch.testing.assert_close(torch.from_numpy(tensor), merged[name], rtol=0, atol=1e-6, msg=name)
    assert {name for name in full if name.startswith("model.visual.")} >= set(step)
