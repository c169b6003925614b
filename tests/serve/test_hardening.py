"""`vlmreg serve` against hostile input: a non-loopback bind without a key, bad load limits, and weight syncs that are
poisoned (NaN / inf), partial, corrupt, going backwards or pointing outside the trainer's weights directory.

Real servers on real sockets and real files; every refusal also asserts that the served model was left unchanged.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import vlmreg
from vlmreg.broadcast import FilesystemReader, FilesystemSender
from vlmreg.broadcast.filesystem import INDEX_FILE
from vlmreg.config import parse_config
from vlmreg.http.auth import is_loopback
from vlmreg.inference.server_link import ServerLink
from vlmreg.inference.server_process import ServerProcess
from vlmreg.sdk.errors import VlmregError
from vlmreg.serve import serve_in_thread
from vlmreg.serve.server import Server

CONFIG = {
    "model": {"init": "random", "family": "qwen3_vl"},
    "trainer": {"device": "cpu"},
    "rollout": {"max_concurrent_rollouts": 2},
}
CONFIG_TOML = '[model]\ninit = "random"\nfamily = "qwen3_vl"\n\n[trainer]\ndevice = "cpu"\n'
REQUIRED = "model.language_model.layers.0.self_attn.q_proj.weight"  # sent by every sync


def _load(seed: int = 0):
    torch.manual_seed(seed)
    return vlmreg.load(parse_config(CONFIG))


def call(url: str, method: str, path: str, body: object = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def snapshot(loaded) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in loaded.model.parameters()]).clone()


@pytest.fixture(scope="module")
def source():
    """A model whose weights differ from the served ones: what the directories below hold."""
    other = _load(seed=1)
    with torch.no_grad():
        for parameter in other.model.parameters():
            parameter.add_(0.5)
    return other


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server started for training (weights without a key) whose --weights-dir is ``root``."""
    root = tmp_path_factory.mktemp("weights-root")
    loaded = _load(seed=0)
    server, url = serve_in_thread(loaded, allow_weights=True, weights_dir=root)
    yield loaded, server, url, root
    server.close()


def rewrite_shard(step_dir: Path, edit) -> None:
    """Apply ``edit(tensors)`` to the directory's one shard and keep its index in step with it."""
    index_path = step_dir / INDEX_FILE
    index = json.loads(index_path.read_text())
    (shard,) = set(index["weight_map"].values())
    tensors = load_file(step_dir / shard)
    edit(tensors)
    save_file(tensors, step_dir / shard, metadata={"format": "pt"})
    index["weight_map"] = {name: shard for name in tensors}
    index_path.write_text(json.dumps(index))


def refused_unchanged(served, body: dict, status: int) -> dict:
    loaded, server, url, _ = served
    before, step = snapshot(loaded), server.weights.step
    code, answer = call(url, "POST", "/v1/weights", body)
    assert code == status, answer
    assert torch.equal(snapshot(loaded), before) and server.weights.step == step
    assert "Traceback" not in answer["error"]["message"]
    return answer["error"]


# -- payloads ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_a_directory_with_non_finite_values_is_refused_naming_the_first_bad_tensor(served, source, value):
    _, _, _, root = served
    step_dir = FilesystemSender(root / f"poison-{value}", source.resolved).write(1)
    order = list(FilesystemReader(step_dir.parent).load(step_dir)[1])
    first, later = order[len(order) // 2], order[-1]

    def poison(tensors):
        tensors[first].view(-1)[3] = value
        tensors[later].view(-1)[0] = float("nan")

    rewrite_shard(step_dir, poison)
    error = refused_unchanged(served, {"step": 1, "path": str(step_dir)}, 409)
    assert f"tensor {first!r}" in error["message"] and later not in error["message"]
    assert error["code"] == "non_finite_weights" and "NaN or infinite" in error["message"]


def test_received_tensors_with_nan_are_refused_and_the_sync_is_consumed(served, source):
    loaded, server, url, _ = served
    step_dir = FilesystemSender(served[3] / "received", source.resolved).write(1)
    tensors = dict(FilesystemReader(step_dir.parent).load(step_dir)[1])
    name = next(iter(tensors))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")

    class Wire:  # stands in for the weight process group: what `Receiver.receive` returns
        calls = 0

        def receive(self, timeout_s=None):
            Wire.calls += 1
            return tensors

    server.weights.receiver = Wire()
    try:
        error = refused_unchanged(served, {"step": 1}, 409)
    finally:
        server.weights.receiver = None
    assert Wire.calls == 1 and f"tensor {name!r}" in error["message"]


def test_a_directory_missing_a_tensor_every_sync_carries_is_refused(served, source):
    _, _, _, root = served
    step_dir = FilesystemSender(root / "partial", source.resolved).write(1)
    rewrite_shard(step_dir, lambda tensors: tensors.pop(REQUIRED))
    error = refused_unchanged(served, {"step": 1, "path": str(step_dir)}, 409)
    assert REQUIRED in error["message"] and "1 missing" in error["message"] and error["code"] == "incomplete_weights"


def test_a_tensor_of_the_wrong_shape_is_refused_by_the_existing_layout_check(served, source):
    _, _, _, root = served
    step_dir = FilesystemSender(root / "reshaped", source.resolved).write(1)
    rewrite_shard(step_dir, lambda tensors: tensors.update({REQUIRED: tensors[REQUIRED][:-1].contiguous()}))
    error = refused_unchanged(served, {"step": 1, "path": str(step_dir)}, 409)
    assert REQUIRED in error["message"] and "do not fit" in error["message"]


def test_a_corrupt_shard_is_a_409_naming_the_directory_not_a_500(served, source):
    _, _, _, root = served
    step_dir = FilesystemSender(root / "corrupt", source.resolved).write(1)
    shard = next(step_dir.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    error = refused_unchanged(served, {"step": 1, "path": str(step_dir)}, 409)
    assert str(step_dir) in error["message"] and error["code"] == "unreadable_weights"


def test_a_step_sync_without_the_frozen_vision_tower_is_taken_and_steps_only_move_forward(tmp_path, source):
    loaded = _load(seed=0)
    server, url = serve_in_thread(loaded, allow_weights=True, weights_dir=tmp_path)
    try:
        sender = FilesystemSender(tmp_path, source.resolved, include_frozen_vision=False, keep=0)
        five, three = sender.write(5), sender.write(3)
        status, answer = call(url, "POST", "/v1/weights", {"step": 5, "path": str(five)})
        assert status == 200 and answer["step"] == 5 and server.weights.step == 5
        backwards = refused_unchanged((loaded, server, url, tmp_path), {"step": 3, "path": str(three)}, 409)
        assert (
            "step 3" in backwards["message"] and "step 5" in backwards["message"] and backwards["code"] == "stale_step"
        )
        # the same step again: a resumed trainer
        assert call(url, "POST", "/v1/weights", {"step": 5, "path": str(five)})[0] == 200
        assert call(url, "GET", "/health")[1]["weights_step"] == 5
    finally:
        server.close()


# -- where a weights directory may be -------------------------------------------------------------------
def test_paths_outside_the_weights_dir_are_refused(served, source, tmp_path):
    _, _, _, root = served
    outside = FilesystemSender(tmp_path / "elsewhere", source.resolved).write(1)
    (root / "link").mkdir(exist_ok=True)
    link = root / "link" / "step_000001"
    link.symlink_to(outside, target_is_directory=True)
    for path in (str(outside), str(link), str(root / ".." / outside.relative_to(root.parent)), str(root), "/etc"):
        error = refused_unchanged(served, {"step": 1, "path": path}, 403)
        assert error["code"] == "path_not_allowed" and "--weights-dir" in error["message"], path


def test_without_a_weights_dir_every_path_is_refused(tmp_path, source):
    loaded = _load(seed=0)
    step_dir = FilesystemSender(tmp_path, source.resolved).write(1)
    server, url = serve_in_thread(loaded, allow_weights=True)
    try:
        error = refused_unchanged((loaded, server, url, None), {"step": 1, "path": str(step_dir)}, 403)
        assert "--weights-dir" in error["message"]
    finally:
        server.close()


def test_a_directory_not_named_step_is_a_400_not_a_500(served, source):
    _, _, _, root = served
    step_dir = FilesystemSender(root / "renamed", source.resolved).write(1)
    renamed = step_dir.rename(step_dir.parent / "weights")
    error = refused_unchanged(served, {"step": 1, "path": str(renamed)}, 400)
    assert "step_NNNNNN" in error["message"]


# -- the CLI ----------------------------------------------------------------------------------------------
@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(CONFIG_TOML)
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("VLMREG_API_KEY", None)
    return subprocess.run(
        [sys.executable, "-m", "vlmreg", "serve", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_loopback_detection():
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "192.168.1.20", "10.0.0.1", "2001:db8::1", "no-such-host.invalid"):
        assert not is_loopback(host), host


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10"])
def test_a_non_loopback_bind_without_a_key_is_refused_before_listening(config_path, host):
    done = run_cli(str(config_path), "--host", host, "--port", "0")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "--api-key-file" in done.stderr and "--insecure-no-api-key" in done.stderr and host in done.stderr
    assert "Traceback" not in done.stderr and "unexpected" not in done.stderr and "loading" not in done.stdout


@pytest.mark.parametrize(
    "option, value",
    [
        ("--max-connections", "0"),
        ("--max-connections", "many"),
        ("--max-queued", "-1"),
        ("--read-timeout", "0"),
        ("--read-timeout", "nan"),
        ("--read-timeout", "inf"),
        ("--read-timeout", "-5"),
    ],
)
def test_bad_load_limits_are_usage_errors(config_path, option, value):
    done = run_cli(str(config_path), "--port", "0", option, value)
    assert done.returncode == 2
    assert "usage:" in done.stderr and option in done.stderr and "Traceback" not in done.stderr


def test_the_insecure_flag_serves_with_the_limits_given(config_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    env.pop("VLMREG_API_KEY", None)
    command = [
        sys.executable,
        "-m",
        "vlmreg",
        "serve",
        str(config_path),
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--insecure-no-api-key",
        "--max-connections",
        "1",
        "--max-queued",
        "7",
        "--read-timeout",
        "2",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        for line in process.stdout:
            if line.startswith("serving"):
                break
        found = re.search(
            r"at http://[^:]+:(\d+)/v1; no API key is checked; at most 1 connections, 7 queued, 2 s read timeout", line
        )
        assert found, line + process.stderr.read()
        url = f"http://127.0.0.1:{found.group(1)}"
        with socket.create_connection(("127.0.0.1", int(found.group(1))), timeout=30) as stalled:
            # holds the one slot
            stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            time.sleep(0.5)
            status, answer = call(url, "GET", "/v1/models")
            assert status == 503 and answer["error"]["code"] == "overloaded"
            started = time.monotonic()
            assert stalled.recv(1024) == b""  # dropped by the read timeout
            assert time.monotonic() - started < 10
        assert call(url, "GET", "/v1/models")[0] == 200
    finally:
        process.terminate()
        process.wait(timeout=20)


# -- the trainer's link -------------------------------------------------------------------------------------
def test_closing_the_link_deletes_the_launched_servers_key(tmp_path):
    link = ServerLink.__new__(ServerLink)
    key = tmp_path / "server.key"
    key.write_text("secret\n")
    link.vllm_server, link.sender, link.output_dir = None, None, tmp_path
    link.processes = [
        ServerProcess(
            "the launched vlmreg serve",
            [sys.executable, "-c", "import time; time.sleep(60)"],
            os.environ,
            tmp_path / "server.log",
            "http://127.0.0.1:1",
        )
    ]
    link.close()
    assert link.processes[0].process.poll() is not None and not key.exists()
    link.close()  # twice: nothing left to delete, no error


def test_the_python_server_refuses_a_key_less_bind_beyond_loopback_too():
    with pytest.raises(VlmregError, match="listening on 0.0.0.0 without an API key"):
        Server("0.0.0.0", 0)
    Server("0.0.0.0", 0, insecure_no_api_key=True).close()
    Server("0.0.0.0", 0, api_key="k" * 24).close()
    Server("127.0.0.1", 0).close()
