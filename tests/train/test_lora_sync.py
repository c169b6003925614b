"""Adapter syncs (LoRA that stays LoRA) into `vlmreg serve` in a separate process, over gloo and the filesystem (CPU).

The reference for what the server must sample from is peft's own: the adapter files peft's ``save_pretrained`` wrote
for the step, loaded by ``PeftModel.from_pretrained`` onto a fresh base model and run as a plain forward.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from PIL import Image
from safetensors.torch import load_file

import vlmreg
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.config.toml_out import to_toml
from vlmreg.data import image_part, text_part
from vlmreg.sdk.engine import SamplingParams
from vlmreg.testing.parity import processor_inputs
from vlmreg.train.recipe import Trainer

QUESTION = "What colour is the shape?"


def config(transport: str, targets: str = "all-linear", steps: int = 2, **broadcast) -> dict:
    return {
        "model": {
            "init": "random",
            "family": "qwen3_vl",
            "lora": {"r": 4, "alpha": 8, "targets": targets},
            "vlm": {"freeze_vision_encoder": False},
        },
        "rollout": {"engine": "openai", "launch": True, "group_size": 4, "max_tokens": 6},
        "broadcast": {"transport": transport, "timeout_s": 60, **broadcast},
        "trainer": {
            "steps": steps,
            "prompts_per_step": 2,
            "learning_rate": 3e-2,
            "seq_len": 256,
            "max_tokens_per_microbatch": 2048,
            "device": "cpu",
            "save_every": 2,
        },
        "logging": {"rollout_page_every": 0, "tensorboard": False},
    }


def spread_adapters(trainer: Trainer) -> None:
    """Give every ``lora_B`` random values (peft starts them at zero, and a tiny random policy barely learns in two
    steps), so that a server holding other adapters, or none, answers visibly otherwise."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)


def server_completion(trainer: Trainer):
    """The server's greedy completion of a fixed image prompt: (prompt ids, completion ids, its logprobs)."""
    image = Image.new("RGB", (64, 64), (200, 30, 30))
    conversation = [{"role": "user", "content": [image_part(trainer.store.add(image)), text_part(QUESTION)]}]
    turn = trainer.engine.chat([conversation], SamplingParams(max_tokens=5, greedy=True), names=["fixed prompt"])[0]
    return turn.prompt.input_ids, turn.completion.token_ids, torch.tensor(turn.completion.logprobs)


def reference_logprobs(
    model: torch.nn.Module, trainer: Trainer, prompt: list[int], completion: list[int]
) -> torch.Tensor:
    """A plain forward of ``model`` on the processor's own encoding of the prompt and completion."""
    image = Image.new("RGB", (64, 64), (200, 30, 30))
    pil = [{"role": "user", "content": [{"type": "image", "image": image}, text_part(QUESTION)]}]
    inputs = processor_inputs(trainer.processor, pil, completion)
    assert inputs["input_ids"][0].tolist() == prompt + completion
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    logits[:, list(trainer.objective.suppress)] = float("-inf")
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def peft_reference(adapter_dir: Path) -> torch.nn.Module:
    """A fresh base model (the run's random init) with peft's adapter files loaded by peft itself."""
    base = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}})
    ).model
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def adapter_file_bytes(adapter_dir: Path, only: str = "") -> int:
    """The bytes of the adapter factors in peft's own file (``only``: names containing it)."""
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    return sum(t.numel() * t.element_size() for name, t in tensors.items() if only in name)


@pytest.mark.parametrize("transport", ["gloo", "filesystem"])
def test_an_adapter_round_trip_into_vlmreg_serve_gives_peft_s_own_logprobs(tmp_path, transport):
    lines: list[str] = []
    trainer = Trainer(resolve_config(parse_config(config(transport))), output_dir=tmp_path, log=lines.append)
    try:
        trainer.setup()
        spread_adapters(trainer)
        trainer.train()
        prompt, completion, served = server_completion(trainer)
        history = list(trainer.link.history)
    finally:
        trainer.cleanup()
    adapter = tmp_path / "adapters" / "step_000002" / "adapter"
    expected = reference_logprobs(peft_reference(adapter), trainer, prompt, completion)
    assert (served - expected).abs().max() <= 1e-5, (served, expected)
    base = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}})
    ).model
    untrained = reference_logprobs(base, trainer, prompt, completion)
    assert (untrained - expected).abs().max() > 1e-3  # the adapters matter: a server without them would fail above
    # what each step sync sent is exactly peft's adapter factors, and the full sync the base model besides
    full, *steps = history
    assert [s.kind for s in history] == ["full", "step", "step"]
    assert [s.bytes for s in steps] == [adapter_file_bytes(adapter)] * 2
    assert full.bytes > 20 * steps[0].bytes
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["sync_bytes"] for m in metrics] == [s.bytes for s in steps] and all(m["sync_s"] > 0 for m in metrics)
    assert all(m["adapter_files_s"] > 0 for m in metrics)  # the step's peft files, written after the sync, timed apart
    assert any("as adapters, 0 merged" in line for line in lines), lines


def test_a_resumed_lora_run_syncs_the_resumed_adapter_version(tmp_path):
    raw = config("gloo", steps=2)
    first = Trainer(resolve_config(parse_config(raw)), output_dir=tmp_path, log=lambda line: None)
    try:
        first.setup()
        spread_adapters(first)
        first.train()
    finally:
        first.cleanup()
    saved = tmp_path / "adapters" / "step_000002" / "adapter"  # written by peft during the first run's last sync
    raw["trainer"]["steps"] = 3
    resumed = Trainer(resolve_config(parse_config(raw)), output_dir=tmp_path, resume=True, log=lambda line: None)
    try:
        resumed.setup()
        assert resumed.step == 2
        # what train() does first: the server starts from the resumed weights
        resumed.link.sync(resumed.step, full=True)
        prompt, completion, served = server_completion(resumed)
        # the adapters went as adapters
        assert resumed.link.history[-1].kind == "full" and resumed.link.lora_split.adapters
    finally:
        resumed.cleanup()
    expected = reference_logprobs(peft_reference(saved), resumed, prompt, completion)
    assert (served - expected).abs().max() <= 1e-5, (served, expected)
    fresh = reference_logprobs(peft_reference_zeroed(saved), resumed, prompt, completion)
    assert (fresh - expected).abs().max() > 1e-3  # a server left with fresh adapters would fail above


def peft_reference_zeroed(adapter_dir: Path) -> torch.nn.Module:
    """The same, with every ``lora_B`` zeroed: what a server that never got the resumed adapters would hold."""
    model = peft_reference(adapter_dir)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.zero_()
    return model


def test_modules_an_attached_server_does_not_serve_as_lora_are_merged_and_said_in_the_log(tmp_path, monkeypatch):
    """The trainer adapts every linear layer (vision included); the server was started serving LoRA on the language
    model only: the vision adapters are merged into base weights each sync, the language ones stay adapters."""
    monkeypatch.setenv("VLMREG_API_KEY", "a-shared-key")  # the server takes weights only from who has its key
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    weights = tmp_path / "weights"
    served = config("filesystem", targets="language", directory=str(weights))
    served["rollout"] = {"engine": "openai", "url": f"http://127.0.0.1:{port}", "group_size": 4, "max_tokens": 6}
    served_toml = tmp_path / "served.toml"
    served_toml.write_text(to_toml(resolve_config(parse_config(served)).config))
    server = subprocess.Popen(
        [sys.executable, "-m", "vlmreg", "serve", str(served_toml), "--port", str(port), "--weights-dir", str(weights)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )
    raw = {**tomllib.loads(served_toml.read_text())}
    raw["model"]["lora"]["targets"] = "all-linear"
    lines: list[str] = []
    trainer = Trainer(resolve_config(parse_config(raw)), output_dir=tmp_path / "run", log=lines.append)
    try:
        trainer.setup()
        spread_adapters(trainer)
        trainer.train()
        prompt, completion, answered = server_completion(trainer)
        split = trainer.link.lora_split
    finally:
        trainer.cleanup()
        server.kill()
        server.wait()
    adapted = {name for name in split.adapters} | set(split.merged)
    assert split.adapters and all(
        ".visual." not in name and not name.startswith("model.visual.") for name in split.adapters
    )
    assert split.merged and all(name.startswith("model.visual.") for name in split.merged)
    assert len(adapted) == len(trainer.loaded.lora.modules)
    assert any(
        f"{len(split.merged)} merged into base weights: {len(split.merged)} not served as LoRA by the server" in line
        for line in lines
    ), lines
    adapter = tmp_path / "run" / "adapters" / "step_000002" / "adapter"
    expected = reference_logprobs(peft_reference(adapter), trainer, prompt, completion)
    assert (answered - expected).abs().max() <= 1e-5, (answered, expected)
    # each step's directory holds the language adapters and the merged vision weights, no language base weight
    index = json.loads((weights / "step_000002" / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".lora_A." in name for name in index) and not any(
        name.startswith("model.language_model.") for name in index
    )
    assert any(name.startswith("model.visual.") for name in index)
