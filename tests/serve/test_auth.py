"""`vlmreg serve`'s API key, on a real socket and through the official ``openai`` client.

Without a key the API is open as before, but ``POST /v1/weights`` (which replaces the served weights) is refused
unless the server was started to take a trainer's syncs. With a key, every request but ``GET /health`` needs
``Authorization: Bearer KEY``: anything else is a 401 and changes nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

import vlmreg
from vlmreg.broadcast import FilesystemSender
from vlmreg.config import parse_config
from vlmreg.http.auth import bearer_matches, read_api_key_file, resolve_api_key
from vlmreg.http.client import HttpStatusError, get_json, post_json
from vlmreg.inference.openai_client import OpenAIEngine, RolloutServerError
from vlmreg.sdk.errors import VlmregError
from vlmreg.serve import serve_in_thread

openai = pytest.importorskip("openai")

KEY = "k3y-for-tests_0123456789abcdefghijklmnopqrstuvwxyz"
MODEL = "qwen3_vl-tiny-random"
CONFIG = {
    "model": {"init": "random", "family": "qwen3_vl"},
    "trainer": {"device": "cpu"},
    "rollout": {"max_concurrent_rollouts": 2},
}
CONFIG_TOML = '[model]\ninit = "random"\nfamily = "qwen3_vl"\n\n[trainer]\ndevice = "cpu"\n'
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _load(seed: int):
    torch.manual_seed(seed)
    return vlmreg.load(parse_config(CONFIG))


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    """A complete filesystem-transport weights directory holding weights unlike the served ones."""
    other = _load(seed=1)
    with torch.no_grad():  # a random init is seeded by the config: make these weights differ from the served ones
        for parameter in other.model.parameters():
            parameter.add_(0.5)
    return FilesystemSender(tmp_path_factory.mktemp("weights"), other.resolved).write(7)


@pytest.fixture(scope="module")
def keyed(weights_dir):
    loaded = _load(seed=0)
    server, url = serve_in_thread(loaded, api_key=KEY, weights_dir=weights_dir.parent)
    yield loaded, server, url
    server.close()


@pytest.fixture(scope="module")
def open_server():
    loaded = _load(seed=0)
    server, url = serve_in_thread(loaded)
    yield loaded, server, url
    server.close()


def call(url: str, method: str, path: str, body: object = None, headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, decoded body, response headers) of one request."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def a_weight(loaded) -> torch.Tensor:
    """Every weight of the served model, flattened (tiny model): equal before and after means nothing was applied."""
    return torch.cat([p.detach().flatten() for p in loaded.model.parameters()]).clone()


ENDPOINTS = [
    ("POST", "/v1/chat/completions", CHAT),
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/v1/weights", {"step": 7}),
    ("GET", "/nope", None),  # no route is revealed to a client without the key either
]
BAD_HEADERS = {
    "missing": {},
    "wrong key": {"Authorization": "Bearer not-the-key"},
    "key with a suffix": {"Authorization": f"Bearer {KEY}x"},
    "other scheme": {"Authorization": f"Basic {KEY}"},
    "no scheme": {"Authorization": KEY},
    "empty bearer": {"Authorization": "Bearer "},
}


@pytest.mark.parametrize("method, path, body", ENDPOINTS, ids=[p for _, p, _ in ENDPOINTS])
@pytest.mark.parametrize("headers", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_a_missing_or_wrong_key_is_a_401_on_every_endpoint(keyed, method, path, body, headers):
    _, _, url = keyed
    status, answer, response_headers = call(url, method, path, body, headers)
    assert status == 401
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in answer["error"]["message"] and KEY not in answer["error"]["message"]
    assert response_headers["WWW-Authenticate"].startswith("Bearer")


def test_a_refused_weights_request_applies_nothing(keyed, weights_dir):
    loaded, server, url = keyed
    before = a_weight(loaded)
    status, _, _ = call(
        url, "POST", "/v1/weights", {"step": 7, "path": str(weights_dir)}, {"Authorization": "Bearer wrong"}
    )
    assert status == 401
    assert torch.equal(a_weight(loaded), before) and server.weights.step is None
    assert call(url, "GET", "/health")[:2] == (200, {"status": "ok", "weights_step": None})


def test_health_is_open_with_a_key(keyed):
    _, _, url = keyed
    assert call(url, "GET", "/health")[:2] == (200, {"status": "ok", "weights_step": None})


def test_the_openai_client_needs_the_right_key(keyed):
    _, _, url = keyed
    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=60) as wrong:
        with pytest.raises(openai.AuthenticationError) as refused:
            wrong.chat.completions.create(**CHAT)
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60) as right:
        assert [m.id for m in right.models.list().data] == [MODEL]
        answer = right.chat.completions.create(**CHAT)
        assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens >= 1
        stream = right.chat.completions.create(**CHAT, stream=True)
        assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in stream)


def test_the_right_key_replaces_the_weights_and_the_trainer_helpers_send_it(keyed, weights_dir):
    loaded, server, url = keyed
    before = a_weight(loaded)
    with pytest.raises(HttpStatusError) as refused:  # the trainer's helper without the key
        post_json(url + "/v1/weights", {"step": 7, "path": str(weights_dir)}, 30)
    assert refused.value.status == 401 and torch.equal(a_weight(loaded), before)
    assert get_json(url + "/v1/models", 10, api_key=KEY)["data"][0]["id"] == MODEL
    answer = post_json(url + "/v1/weights", {"step": 7, "path": str(weights_dir)}, 60, api_key=KEY)
    assert answer["step"] == 7 and answer["tensors"] > 0
    assert not torch.equal(a_weight(loaded), before) and server.weights.step == 7


def test_the_rollout_engine_sends_its_api_key(keyed):
    loaded, _, url = keyed
    without = OpenAIEngine(url, loaded.processor, None, max_retries=0)
    with pytest.raises(RolloutServerError, match="HTTP 401"):
        without._first_model()
    assert OpenAIEngine(url, loaded.processor, None, max_retries=0, api_key=KEY)._first_model() == MODEL


def test_without_a_key_the_api_is_open_but_weights_are_refused(open_server, weights_dir):
    loaded, server, url = open_server
    with openai.OpenAI(base_url=url + "/v1", api_key="anything", max_retries=0, timeout=60) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        assert client.chat.completions.create(**CHAT).choices[0].finish_reason in ("stop", "length")
    before = a_weight(loaded)
    status, answer, _ = call(url, "POST", "/v1/weights", {"step": 7, "path": str(weights_dir)})
    assert status == 403
    assert "--api-key-file" in answer["error"]["message"] and "--weights-from" in answer["error"]["message"]
    assert torch.equal(a_weight(loaded), before) and server.weights.step is None


def test_a_server_started_for_training_takes_weights_without_a_key(weights_dir):
    loaded = _load(seed=0)
    before = a_weight(loaded)
    server, url = serve_in_thread(loaded, allow_weights=True, weights_dir=weights_dir.parent)
    try:
        status, answer, _ = call(url, "POST", "/v1/weights", {"step": 7, "path": str(weights_dir)})
        assert status == 200 and answer["step"] == 7
        assert not torch.equal(a_weight(loaded), before)
    finally:
        server.close()


# -- where the key comes from ---------------------------------------------------------------------
def key_file(tmp_path: Path, mode: int, text: str = KEY + "\n") -> Path:
    path = tmp_path / "server.key"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_private_key_file_is_read(tmp_path):
    assert read_api_key_file(key_file(tmp_path, 0o600)) == KEY
    assert read_api_key_file(key_file(tmp_path, 0o400)) == KEY


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_a_key_file_open_to_group_or_others_is_refused(tmp_path, mode):
    path = key_file(tmp_path, mode)
    with pytest.raises(VlmregError, match=rf"{re.escape(str(path))}.*mode {mode:04o}.*chmod 600"):
        read_api_key_file(path)


@pytest.mark.parametrize("text", ["", "  \n", "two words", "ключ"])
def test_an_empty_or_unsendable_key_is_refused(tmp_path, text):
    with pytest.raises(VlmregError, match="API key"):
        read_api_key_file(key_file(tmp_path, 0o600, text))


def test_the_environment_variable_gives_the_key_and_a_file_wins(tmp_path):
    assert resolve_api_key(None, {}) is None
    assert resolve_api_key(None, {"VLMREG_API_KEY": "from-env\n"}) == "from-env"
    assert resolve_api_key(key_file(tmp_path, 0o600), {"VLMREG_API_KEY": "from-env"}) == KEY
    with pytest.raises(VlmregError, match="VLMREG_API_KEY.*empty"):
        resolve_api_key(None, {"VLMREG_API_KEY": ""})


def test_bearer_matching():
    assert bearer_matches(f"Bearer {KEY}", KEY) and bearer_matches(f"bearer  {KEY} ", KEY)
    for header in (None, "", KEY, f"Basic {KEY}", f"Bearer {KEY[:-1]}", f"Bearer {KEY}\u00e9", "Bearer"):
        assert not bearer_matches(header, KEY), header


# -- the CLI ----------------------------------------------------------------------------------------
@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(CONFIG_TOML)
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``vlmreg serve`` in a process of its own, with a deadline: a refusal that regressed fails instead of serving
    forever."""
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("VLMREG_API_KEY", None)
    return subprocess.run(
        [sys.executable, "-m", "vlmreg", "serve", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_the_cli_refuses_a_key_file_open_to_others_before_listening(tmp_path, config_path):
    path = key_file(tmp_path, 0o644)
    done = run_cli(str(config_path), "--port", "0", "--api-key-file", str(path))
    assert done.returncode == 1
    assert str(path) in done.stderr and "chmod 600" in done.stderr
    assert "Traceback" not in done.stderr and "unexpected" not in done.stderr and "serving" not in done.stdout


def test_the_cli_names_a_missing_key_file(tmp_path, config_path):
    path = tmp_path / "absent.key"
    done = run_cli(str(config_path), "--port", "0", "--api-key-file", str(path))
    assert done.returncode == 1
    assert str(path) in done.stderr and "no such file" in done.stderr
    assert "Traceback" not in done.stderr and "unexpected" not in done.stderr and "serving" not in done.stdout


@pytest.mark.parametrize("source", ["file", "environment"])
def test_the_cli_serves_with_a_key(tmp_path, config_path, source):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    env.pop("VLMREG_API_KEY", None)
    command = [sys.executable, "-m", "vlmreg", "serve", str(config_path), "--port", "0"]
    if source == "file":
        command += ["--api-key-file", str(key_file(tmp_path, 0o600))]
    else:
        env["VLMREG_API_KEY"] = KEY
    assert KEY not in " ".join(command)  # never on the command line, where ps shows it
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        for line in process.stdout:
            found = re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)/v1; an API key is required", line)
            if found:
                url = found.group(1)
                break
        assert url, process.stderr.read()
        assert call(url, "GET", "/health")[0] == 200
        assert call(url, "GET", "/v1/models")[0] == 401
        assert call(url, "POST", "/v1/weights", {"step": 1})[0] == 401
        assert call(url, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    finally:
        process.terminate()
        process.wait(timeout=20)
