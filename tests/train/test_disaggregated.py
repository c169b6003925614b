"""Training against `vlmreg serve` in a separate process, weights synced over gloo or the filesystem (CPU)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from PIL import Image

import vlmreg
from vlmreg.broadcast import WeightPlan
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.config.toml_out import to_toml
from vlmreg.data import image_part, text_part
from vlmreg.inference import server_link
from vlmreg.inference.calls import free_port
from vlmreg.sdk.engine import SamplingParams
from vlmreg.sdk.errors import VlmregError
from vlmreg.testing.parity import processor_inputs
from vlmreg.train.recipe import Trainer


def config(transport: str, **rollout):
    return resolve_config(
        parse_config(
            {
                "model": {"init": "random", "family": "qwen3_vl"},
                "rollout": {"engine": "openai", "launch": True, "group_size": 4, "max_tokens": 6, **rollout},
                "broadcast": {"transport": transport, "timeout_s": 60},
                "trainer": {
                    "steps": 3,
                    "prompts_per_step": 2,
                    "learning_rate": 3e-3,
                    "seq_len": 256,
                    "max_tokens_per_microbatch": 2048,
                    "device": "cpu",
                },
                "logging": {"rollout_page_every": 0, "tensorboard": False},
            }
        )
    )


def server_matches_trainer(trainer: Trainer) -> float:
    """Greedy completion from the server for a fixed prompt; the largest gap to the trainer's own logprobs."""
    image = Image.new("RGB", (64, 64), (200, 30, 30))
    conversation = [
        {"role": "user", "content": [image_part(trainer.store.add(image)), text_part("What colour is the shape?")]}
    ]
    turn = trainer.engine.chat([conversation], SamplingParams(max_tokens=5, greedy=True), names=["fixed prompt"])[0]
    pil = [{"role": "user", "content": [{"type": "image", "image": image}, text_part("What colour is the shape?")]}]
    inputs = processor_inputs(trainer.processor, pil, turn.completion.token_ids)  # the processor's own encoding
    assert inputs["input_ids"][0].tolist() == turn.prompt.input_ids + turn.completion.token_ids
    with torch.no_grad():
        logits = trainer.model(**inputs, use_cache=False).logits[0, len(turn.prompt.input_ids) - 1 : -1].float()
    logits[:, list(trainer.objective.suppress)] = float("-inf")
    mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(turn.completion.token_ids)[:, None]).squeeze(-1)
    return float((mine - torch.tensor(turn.completion.logprobs)).abs().max())


@pytest.mark.parametrize("transport", ["gloo", "filesystem"])
def test_training_against_a_launched_server_keeps_its_weights_equal(tmp_path, transport):
    trainer = Trainer(config(transport), output_dir=tmp_path, log=lambda message: None)
    gaps = []
    try:
        trainer.setup()
        trainer.on_step = lambda record: gaps.append((record["mismatch_kl"], server_matches_trainer(trainer)))
        trainer.train()
        assert trainer.link.processes[0].process.poll() is None and trainer.link.step_synced == 3
        if transport == "gloo":
            full, *steps = trainer.link.history
            assert [s.kind for s in trainer.link.history] == ["full", "step", "step", "step"]
            assert all(s.bytes < full.bytes for s in steps)  # the frozen vision tower went once, at the start
        else:
            written = sorted(p.name for p in (tmp_path / "weights").iterdir() if p.name.startswith("step_"))
            assert written[-1] == "step_000003"
    finally:
        trainer.cleanup()
    assert len(gaps) == 3
    assert all(gap <= 1e-5 for _, gap in gaps), gaps  # after every sync the server is the trainer's policy
    assert all(kl < 1e-8 for kl, _ in gaps)
    # each step's 2 groups of 4 went as 2 requests of n = 4 (rollout.share_prompts), plus one check a step (above)
    assert (tmp_path / "server.log").read_text().count('"POST /v1/chat/completions') == 3 * 2 + 3
    assert trainer.link.processes[0].process.poll() is not None  # stopped with the run


def test_a_server_that_dies_is_an_error_naming_it(tmp_path):
    trainer = Trainer(config("gloo"), output_dir=tmp_path, log=lambda message: None)
    try:
        trainer.setup()

        def kill(record):
            trainer.link.processes[0].process.kill()
            trainer.link.processes[0].process.wait()

        trainer.on_step = kill
        with pytest.raises(VlmregError, match=r"rollout server .*(exited with code|failed)"):
            trainer.train()
        assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
    finally:
        trainer.cleanup()


def test_a_server_that_dies_while_the_trainer_waits_for_it_to_take_a_sync_is_named_at_once(tmp_path, monkeypatch):
    """The server killed after the trainer's last look at it and before it said it was ready for the sync (the POST that
    asks it to take the weights finds it dead): the sender's wait for "ready" calls the launched server's check, so the
    run stops at once naming the server. Before, the link never handed that check to the gloo sender, and the wait went
    on for broadcast.timeout_s (600 s by default; 60 s here)."""
    trainer = Trainer(config("gloo"), output_dir=tmp_path, log=lambda message: None)
    try:
        trainer.setup()
        server = trainer.link.processes[0]
        post = server_link.post_json

        def kill_then_post(url, body, *args, **kwargs):
            if url.endswith("/v1/weights"):
                server.process.kill()
            return post(url, body, *args, **kwargs)

        monkeypatch.setattr(server_link, "post_json", kill_then_post)
        started = time.monotonic()
        with pytest.raises(VlmregError, match=rf"rollout server .*pid {server.pid}\) exited with code -9"):
            trainer.link.sync(1)
        assert time.monotonic() - started < 15  # not the 60 s of broadcast.timeout_s
    finally:
        trainer.cleanup()


def test_an_attached_server_that_dies_while_the_trainer_waits_for_it_to_take_a_sync_is_named_at_once(
    tmp_path, monkeypatch
):
    """An attached server (no process the trainer can watch) killed as the sync's POST leaves: the POST fails at once,
    and the sender's wait for "ready" stops on that failure, naming the server's URL. Before, the wait went on for
    broadcast.timeout_s (60 s here; 600 s by default)."""
    monkeypatch.setenv("VLMREG_WEIGHTS_TOKEN", "a-shared-secret")
    port, http_port = free_port(), free_port()
    served = tmp_path / "served.toml"
    served.write_text('[model]\ninit = "random"\nfamily = "qwen3_vl"\n')
    argv = [sys.executable, "-m", "vlmreg", "serve", str(served), "--port", str(http_port)]
    argv += ["--weights-from", f"127.0.0.1:{port}", "--weights-timeout", "60"]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{http_port}"
    rc = resolve_config(
        parse_config(
            {
                "model": {"init": "random", "family": "qwen3_vl"},
                "rollout": {"engine": "openai", "url": url},
                "broadcast": {"transport": "gloo", "port": port, "timeout_s": 60},
                "trainer": {"device": "cpu"},
            }
        )
    )
    trainer = Trainer(rc, output_dir=tmp_path / "run", log=lambda message: None)
    try:
        trainer.setup()
        post = server_link.post_json

        def kill_then_post(target, body, *args, **kwargs):
            if target.endswith("/v1/weights"):
                server.kill()
                server.wait()
            return post(target, body, *args, **kwargs)

        monkeypatch.setattr(server_link, "post_json", kill_then_post)
        started = time.monotonic()
        with pytest.raises(VlmregError, match=re.escape(url)):
            trainer.link.sync(1)
        assert time.monotonic() - started < 15  # not the 60 s of broadcast.timeout_s
    finally:
        server.kill()
        trainer.cleanup()


def test_a_server_with_another_model_is_refused_naming_a_tensor(tmp_path, monkeypatch):
    # an attached server joins only with the trainer's token
    monkeypatch.setenv("VLMREG_WEIGHTS_TOKEN", "a-shared-secret")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    other = tmp_path / "other.toml"
    other.write_text('[model]\ninit = "random"\nfamily = "qwen3_5"\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vlmreg",
            "serve",
            str(other),
            "--port",
            str(http_port),
            "--weights-from",
            f"127.0.0.1:{port}",
            "--weights-timeout",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )
    rc = resolve_config(
        parse_config(
            {
                "model": {"init": "random", "family": "qwen3_vl"},
                "rollout": {"engine": "openai", "url": f"http://127.0.0.1:{http_port}"},
                "broadcast": {"transport": "gloo", "port": port, "timeout_s": 60},
                "trainer": {"device": "cpu"},
            }
        )
    )
    trainer = Trainer(rc, output_dir=tmp_path / "run", log=lambda message: None)
    try:
        with pytest.raises(VlmregError, match=r"rejected the weights: .*model\.language_model\.layers\.0\."):
            trainer.setup()
        output = server.communicate(timeout=60)[0]
        assert server.returncode == 1 and "Traceback" not in output
        assert "nothing was received or applied" in " ".join(output.split())
    finally:
        server.kill()
        trainer.cleanup()


def test_an_attached_server_without_a_shared_weight_token_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.delenv("VLMREG_WEIGHTS_TOKEN", raising=False)
    rc = resolve_config(
        parse_config(
            {
                "model": {"init": "random", "family": "qwen3_vl"},
                "rollout": {"engine": "openai", "url": "http://127.0.0.1:9"},
                "broadcast": {"transport": "gloo", "port": 29999, "timeout_s": 5},
                "trainer": {"device": "cpu"},
            }
        )
    )
    trainer = Trainer(rc, output_dir=tmp_path / "run", log=lambda message: None)
    try:
        with pytest.raises(VlmregError, match="set the same secret in VLMREG_WEIGHTS_TOKEN"):
            trainer.setup()
    finally:
        trainer.cleanup()


def test_with_lora_the_server_gets_merged_weights_and_each_step_s_adapter_files_are_written(tmp_path):
    rc = config("gloo")
    lora = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}
    raw = _raw(rc)
    raw["broadcast"]["lora_sync"] = "merged"  # adapter syncs (the default): tests/train/test_lora_sync.py
    rc = resolve_config(parse_config({**raw, "model": {"init": "random", "family": "qwen3_vl", "lora": lora}}))
    trainer = Trainer(rc, output_dir=tmp_path, log=lambda message: None)
    try:
        trainer.setup()
        trainer.train()
        gap = server_matches_trainer(trainer)
        assert trainer.link.history[-1].bytes > 10 * sum(
            p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if "lora_" in n
        )
        merged = dict(WeightPlan.from_resolved(trainer.resolved, include_frozen_vision=False).tensors())
    finally:
        trainer.cleanup()
    assert gap <= 1e-5  # the server samples from base + LoRA
    written = sorted(p.name for p in (tmp_path / "adapters").iterdir() if p.name.startswith("step_"))
    assert written == ["step_000002", "step_000003"]  # the newest two of steps 0..3
    base = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}})
    ).model
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapters" / "step_000003" / "adapter").merge_and_unload()
    state = loaded.state_dict()  # peft's own loader and merge: the reference
    reference = dict(WeightPlan.from_resolved(vlmreg.resolve(loaded), include_frozen_vision=False).tensors())
    assert state and reference.keys() == merged.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(reference[name], tensor, rtol=0, atol=1e-6, msg=name)


def _raw(rc):
    """The test config as a plain dict again (to add a [model.lora] table)."""

    return tomllib.loads(to_toml(rc.config))


# -- several servers, and servers that die -------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["gloo", "filesystem"])
def test_two_launched_servers_both_sample_every_step_and_both_hold_the_trainer_s_weights(tmp_path, transport):
    """One sync reaches both servers: after every step, each server's logprobs are the trainer's (a plain forward of its
    model), and the step's groups were spread over both (each group on one server)."""
    trainer = Trainer(config(transport, servers=2), output_dir=tmp_path, log=lambda message: None)
    gaps, spread = [], []
    try:
        trainer.setup()
        assert len(trainer.link.processes) == 2 and len(set(trainer.link.urls)) == 2
        pool = trainer.engine

        def check(record):
            spread.append(record["rollout_completions_per_server"])
            for engine in pool.engines:  # ask each server alone
                trainer.engine = engine
                gaps.append(server_matches_trainer(trainer))
            trainer.engine = pool

        trainer.on_step = check
        trainer.train()
        if transport == "gloo":
            # one broadcast per sync, not one per server
            assert [s.kind for s in trainer.link.history] == ["full", "step", "step", "step"]
    finally:
        trainer.cleanup()
    assert spread == [[4, 4]] * 3, spread  # 2 groups of 4 a step, one group on each server
    assert len(gaps) == 6 and max(gaps) <= 1e-5, gaps
    assert all(p.process.poll() is not None for p in trainer.link.processes)  # both stopped with the run


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (Linux /proc): `vlmreg train` starts one, its server (traced)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        children = (task / "children").read_text().split() if (task / "children").exists() else []
        found += [int(c) for c in children]
    return found


@pytest.mark.parametrize("when", ["before-ready", "mid-run"])
def test_vlmreg_train_ends_within_30_s_when_its_launched_server_is_killed(tmp_path, when):
    """A launched server killed before it is ready (while the trainer waits for it to join the weight group) or after
    the first step ends `vlmreg train` at once, naming the server, its exit code and its log."""
    raw = tmp_path / "run.toml"
    raw.write_text(
        '[model]\ninit = "random"\nfamily = "qwen3_vl"\n'
        '[rollout]\nengine = "openai"\nlaunch = true\ngroup_size = 4\nmax_tokens = 6\n'
        '[broadcast]\ntransport = "gloo"\ntimeout_s = 600\n'
        '[trainer]\nsteps = 50\nprompts_per_step = 2\nseq_len = 256\ndevice = "cpu"\n'
        f'output_dir = "{tmp_path / "out"}"\n[logging]\nrollout_page_every = 0\ntensorboard = false\n'
    )
    # every thread's stack on stderr 35 s after the start, and again each 35 s: a run that is still going when the
    # test gives up on it shows where it waits
    env = {**os.environ, "VLMREG_STACKS_EVERY": "35"}
    train = subprocess.Popen(
        [sys.executable, "-m", "vlmreg", "train", str(raw)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    output = ""
    try:
        server = None
        deadline = time.monotonic() + 120
        while server is None and time.monotonic() < deadline and train.poll() is None:
            server = next(iter(_children(train.pid)), None)
            time.sleep(0.05)
        if server is None:
            train.kill()
            pytest.fail(f"the trainer launched no server; its output:\n{train.communicate()[0][-6000:]}")
        if when == "mid-run":
            metrics = tmp_path / "out" / "metrics.jsonl"
            while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
                time.sleep(0.1)
                assert train.poll() is None, "vlmreg train ended before its first step"
            assert metrics.read_text().strip(), "no step finished"
        os.kill(server, 9)
        killed = time.monotonic()
        try:
            output, _ = train.communicate(timeout=75)
        except subprocess.TimeoutExpired:
            train.kill()
            output, _ = train.communicate()
            pytest.fail(f"vlmreg train still ran 75 s after its server was killed; its output:\n{output[-6000:]}")
        took = time.monotonic() - killed
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
    assert f"launched vlmreg serve (pid {server})" in output, output  # the process killed was the server
    assert train.returncode == 1, output
    assert took < 30, (took, output)
    assert re.search(rf"error: .*rollout server .*pid {server}\) exited with code -9.*log: .*server\.log", output), (
        output
    )
    assert "Traceback" not in output


def test_two_attached_servers_join_one_weight_group_as_ranks_1_and_2(tmp_path, monkeypatch):
    """`[rollout] url` as a list: two `vlmreg serve` started apart (``--weights-rank 1`` and ``2``) take every sync from
    one broadcast, and both sample every step."""
    monkeypatch.setenv("VLMREG_WEIGHTS_TOKEN", "a-shared-secret")
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    group, *http = ports
    served = tmp_path / "served.toml"
    served.write_text('[model]\ninit = "random"\nfamily = "qwen3_vl"\n')
    servers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vlmreg",
                "serve",
                str(served),
                "--port",
                str(port),
                "--weights-from",
                f"127.0.0.1:{group}",
                "--weights-rank",
                str(rank),
                "--weights-timeout",
                "60",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ),
        )
        for rank, port in enumerate(http, start=1)
    ]
    rc = resolve_config(
        parse_config(
            {
                "model": {"init": "random", "family": "qwen3_vl"},
                "rollout": {
                    "engine": "openai",
                    "url": [f"http://127.0.0.1:{p}" for p in http],
                    "group_size": 4,
                    "max_tokens": 6,
                },
                "broadcast": {"transport": "gloo", "port": group, "timeout_s": 60},
                "trainer": {"steps": 2, "prompts_per_step": 2, "learning_rate": 3e-3, "seq_len": 256, "device": "cpu"},
                "logging": {"rollout_page_every": 0, "tensorboard": False},
            }
        )
    )
    trainer = Trainer(rc, output_dir=tmp_path / "run", log=lambda message: None)
    gaps, spread = [], []
    try:
        trainer.setup()
        pool = trainer.engine

        def check(record):
            spread.append(record["rollout_completions_per_server"])
            for engine in pool.engines:
                trainer.engine = engine
                gaps.append(server_matches_trainer(trainer))
            trainer.engine = pool

        trainer.on_step = check
        trainer.train()
    finally:
        trainer.cleanup()
        for server in servers:
            server.kill()
            server.wait()
    assert spread == [[4, 4]] * 2, spread
    assert len(gaps) == 4 and max(gaps) <= 1e-5, gaps
