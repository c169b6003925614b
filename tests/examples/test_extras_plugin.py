"""A pip-installed third-party plugin brings its own objective, rewards, rollout engine and weight transport; `vlmreg
plugins` lists them; a run uses each (a trace file proves that they ran, and the launched server's policy is the
trainer's after the plugin's transport synced it)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlmreg.config import load_config
from vlmreg.config.resolve import resolve_config
from vlmreg.data import image_part, text_part
from vlmreg.http.client import get_json
from vlmreg.sdk.engine import SamplingParams
from vlmreg.sdk.registry import reset_registry
from vlmreg.testing.parity import processor_inputs
from vlmreg.train.recipe import Trainer

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "plugins" / "vlmreg-example-extras"


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(PLUGIN)],
        check=True,
        capture_output=True,
        text=True,
    )
    base = {k: v for k, v in os.environ.items() if k not in ("VLMREG_PLUGINS", "VLMREG_EXTRAS_TRACE")}
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []  # a checkout's src/, say
    return {**base, "PYTHONPATH": os.pathsep.join([str(site), *inherited])}


def vlmreg(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmreg", *args], capture_output=True, text=True, env=env)


def test_listed_under_its_distribution(env):
    result = vlmreg("plugins", "--json", env=env)
    assert result.returncode == 0, result.stderr
    record = {r["name"]: r for r in json.loads(result.stdout)}["extras"]
    assert record["distribution"] == "vlmreg-example-extras" and record["version"] == "0.1.0"
    assert record["objectives"] == ["reinforce"] and record["rewards"] == ["one_word", "slow_exact_match"]
    assert record["rollout_engines"] == ["logged_openai"] and record["transports"] == ["one_file"]
    assert record["hooks"] == [
        "vlmreg_register_objectives",
        "vlmreg_register_rewards",
        "vlmreg_register_rollout_engines",
        "vlmreg_register_transports",
    ]
    text = vlmreg("plugins", env={**env, "COLUMNS": "400"})
    assert (
        text.returncode == 0
        and "rollout_engines: logged_openai" in text.stdout
        and "transports: one_file" in text.stdout
    )


def test_the_plugin_s_objective_takes_the_run_s_loss_aggregation(env):
    """It declares an aggregation, so ``loss_aggregation`` applies to it (one that normalises itself is refused)."""
    result = vlmreg(
        "config",
        str(PLUGIN / "config.toml"),
        "--resolved",
        "--set",
        "trainer.loss_aggregation=seq-mean-token-sum",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert 'loss_aggregation = "seq-mean-token-sum"' in result.stdout


def test_a_run_uses_the_plugin_s_objective_and_rewards(env, tmp_path):
    trace = tmp_path / "trace.txt"
    out = tmp_path / "run"
    result = vlmreg(
        "train",
        str(PLUGIN / "config.toml"),
        "--set",
        "trainer.steps=2",
        "--output-dir",
        str(out),
        env={**env, "VLMREG_EXTRAS_TRACE": str(trace)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    calls = trace.read_text().split()
    samples = 2 * 4 * 4  # steps x prompts x group
    assert calls.count("one_word") == samples and calls.count("slow_exact_match") == samples
    assert calls.count("objective") >= 2  # at least one micro-batch a step
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["clip_fraction"] == 0 for r in records)


def test_the_server_config_validates_and_a_typo_in_its_transport_gets_a_suggestion(env):
    assert vlmreg("validate", str(PLUGIN / "server.toml"), env=env).returncode == 0
    typo = vlmreg("validate", str(PLUGIN / "server.toml"), "--set", "broadcast.transport=one_fil", env=env)
    assert typo.returncode == 1 and "Unknown transport 'one_fil'. Did you mean 'one_file'?" in " ".join(
        typo.stderr.split()
    )
    # one_file has a vLLM end too (tests/inference/test_vllm_server.py runs it in vLLM's workers), and the plugin's
    # server engine takes a launched vLLM under openai's rules
    vllm = vlmreg("validate", str(PLUGIN / "server.toml"), "--set", "rollout.server=vllm", env=env)
    assert vllm.returncode == 0, vllm.stderr
    unsynced = vlmreg(
        "validate",
        str(PLUGIN / "server.toml"),
        "--set",
        "rollout.server=vllm",
        "--set",
        "broadcast.transport=none",
        env=env,
    )
    assert (
        unsynced.returncode == 1
        and 'must send the trained weights to the server with engine = "logged_openai"' in unsynced.stderr
    )


@pytest.fixture
def installed(env, monkeypatch, vlmreg_fresh_registry):
    """The plugin importable in this process and in the servers it launches, for one test."""
    monkeypatch.syspath_prepend(env["PYTHONPATH"].split(os.pathsep)[0])  # the plugin's site folder
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    monkeypatch.delenv("VLMREG_PLUGINS", raising=False)

    reset_registry()


def greedy_gap(trainer, model) -> float:
    """The largest gap between the server's logprobs of its greedy completion of a fixed prompt and ``model``'s."""

    image = Image.new("RGB", (64, 64), (30, 200, 30))
    conversation = [
        {"role": "user", "content": [image_part(trainer.store.add(image)), text_part("What colour is the shape?")]}
    ]
    turn = trainer.engine.chat([conversation], SamplingParams(max_tokens=5, greedy=True), names=["fixed prompt"])[0]
    pil = [{"role": "user", "content": [{"type": "image", "image": image}, text_part("What colour is the shape?")]}]
    inputs = processor_inputs(trainer.processor, pil, turn.completion.token_ids)
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits[0, len(turn.prompt.input_ids) - 1 : -1].float()
    logits[:, list(trainer.objective.suppress)] = float("-inf")
    mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(turn.completion.token_ids)[:, None]).squeeze(-1)
    return float((mine - torch.tensor(turn.completion.logprobs)).abs().max())


def test_a_run_samples_through_the_plugin_s_engine_and_syncs_through_its_transport(installed, tmp_path, monkeypatch):
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("VLMREG_EXTRAS_TRACE", str(trace))  # the launched server inherits it: its receiver traces too
    out = tmp_path / "run"
    rc = resolve_config(load_config(PLUGIN / "server.toml", ["trainer.steps=2", "trainer.prompts_per_step=2"]))
    trainer = Trainer(rc, output_dir=out, log=lambda message: None)
    try:
        trainer.setup()  # launches `vlmreg serve` on the same config: the same random weights as the trainer's
        initial = copy.deepcopy(trainer.model).eval()
        assert type(trainer.engine).__name__ == "LoggedEngine" and type(trainer.link.sender).__name__ == "OneFileSender"
        # the tiny random policy earns no reward on this task, so its updates are zero: move its weights by hand, so
        # that the server can only match the trainer if the transport carried them over
        with torch.no_grad():
            for parameter in trainer.model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.02)
        trainer.train()
        # the server applied the last step's file
        assert get_json(f"{trainer.link.url}/health", 30)["weights_step"] == 2
        trained_gap, initial_gap = greedy_gap(trainer, trainer.model), greedy_gap(trainer, initial)
    finally:
        trainer.cleanup()
    assert trained_gap <= 1e-5, trained_gap  # the server samples from the trainer's weights...
    assert initial_gap > 1e-3, initial_gap  # ...which moved away from the ones both started from
    calls = trace.read_text().split()
    syncs = 1 + 2  # the full sync before the first rollouts, then one per step
    assert calls.count("sender") == syncs and calls.count("receiver") == syncs, calls
    assert calls.count("engine") >= 2 + 2  # every step's rollouts, and the two probes above
    batches = [json.loads(line) for line in (out / "rollout_calls.jsonl").read_text().splitlines()]
    assert [b["conversations"] for b in batches[:2]] == [2 * 4, 2 * 4]  # prompts x group, per step
    assert sorted(p.name for p in (out / "one_file").iterdir()) == [
        "step_000001.safetensors",
        "step_000002.safetensors",
    ]
