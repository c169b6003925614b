"""`vlmreg serve` on a real socket: token ids and logprobs, batching, between_batches, and clean 400s."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image

import vlmreg
from vlmreg.config import parse_config
from vlmreg.data.prompts import vision_token_ids
from vlmreg.serve import Server, serve_in_thread
from vlmreg.testing.parity import processor_inputs

CPU = torch.device("cpu")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
BATCH = 4


@pytest.fixture(scope="module")
def served():
    torch.manual_seed(0)
    config = {
        "model": {"init": "random", "family": "qwen3_vl"},
        "trainer": {"device": "cpu"},
        "rollout": {"max_concurrent_rollouts": BATCH},
    }
    loaded = vlmreg.load(parse_config(config))
    server, url = serve_in_thread(loaded)
    yield loaded, server, url
    server.close()


def png_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def post(url: str, body: object, *, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(url: str, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + path, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def image_message(colour: str = "red", text: str = "What colour?") -> dict:
    image = {"type": "image_url", "image_url": {"url": png_uri(Image.new("RGB", (64, 64), colour))}}
    return {"role": "user", "content": [image, {"type": "text", "text": text}]}


def test_an_image_request_gets_the_exact_prompt_and_the_logprobs_it_was_sampled_with(served):
    loaded, _, url = served
    temperature = 0.7
    status, body = post(
        url,
        {
            "messages": [image_message()],
            "n": 2,
            "temperature": temperature,
            "max_tokens": 6,
            "logprobs": True,
            "return_token_ids": True,
        },
    )
    assert status == 200, body
    conversation = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": Image.new("RGB", (64, 64), "red")},
                {"type": "text", "text": "What colour?"},
            ],
        }
    ]
    prompt = body["prompt_token_ids"]
    # the processor's own encoding
    assert prompt == processor_inputs(loaded.processor, conversation, [])["input_ids"][0].tolist()
    assert body["model"] == "qwen3_vl-tiny-random" and len(body["choices"]) == 2
    suppress = list(vision_token_ids(loaded.processor, loaded.resolved.descriptor))
    for choice in body["choices"]:
        ids = choice["token_ids"]
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert len(ids) == len(logprobs) > 0 and not set(ids) & set(suppress)
        assert choice["finish_reason"] == (
            "stop" if ids[-1] == loaded.processor.tokenizer.convert_tokens_to_ids("<|im_end|>") else "length"
        )
        assert choice["message"]["content"] == loaded.processor.tokenizer.decode(ids, skip_special_tokens=True)
        inputs = processor_inputs(loaded.processor, conversation, ids)
        with torch.no_grad():
            logits = loaded.model(**inputs, use_cache=False).logits[0, len(prompt) - 1 : -1].float() / temperature
        logits[:, suppress] = float("-inf")
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert torch.allclose(expected, torch.tensor(logprobs), atol=1e-4)
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == sum(
        len(c["token_ids"]) for c in body["choices"]
    )


def test_greedy_and_seeded_requests_repeat_and_plain_ones_carry_no_extras(served):
    _, _, url = served
    greedy = {"messages": [image_message("green")], "temperature": 0, "max_tokens": 5, "return_token_ids": True}
    seeded = {
        "messages": [{"role": "user", "content": "hello"}],
        "seed": 7,
        "max_completion_tokens": 5,
        "return_token_ids": True,
    }
    for body in (greedy, seeded):
        first, second = post(url, body)[1], post(url, body)[1]
        assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    status, plain = post(url, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
    assert status == 200 and "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert plain["choices"][0]["logprobs"] is None and plain["usage"]["completion_tokens"] <= 3


def test_concurrent_clients_share_batches(served):
    _, server, url = served
    server.worker.largest_batch = 0
    gate = threading.Event()
    held = server.between_batches(lambda model: gate.wait(10))  # hold the worker while requests queue up
    body = {"messages": [image_message("blue")], "max_tokens": 4, "logprobs": True, "return_token_ids": True}
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(post, url, body) for _ in range(12)]
        for _ in range(200):
            if server.worker.pending == 6:
                break
            threading.Event().wait(0.01)
        assert server.worker.pending == 6
        gate.set()
        results = [f.result() for f in futures]
    assert held.result() is True
    assert all(
        status == 200 and len(b["choices"][0]["token_ids"]) == len(b["choices"][0]["logprobs"]["content"])
        for status, b in results
    )
    assert server.worker.largest_batch == BATCH  # six were waiting: the next batch took as many as fit


def test_between_batches_runs_between_batches_while_requests_are_in_flight(served, monkeypatch):
    loaded, server, url = served
    worker = server.worker
    events: list[str] = []
    hooks = []

    def swap(model):
        assert not worker.generating and threading.current_thread().name == "vlmreg-serve-worker"
        events.append("swap")
        return model is loaded.model

    original = worker.engine.generate

    def generate(requests, params, **kwargs):
        events.append(f"start {len(requests)}")
        if not hooks:  # asked for while a batch runs: it must wait for the end of this batch
            hooks.append(server.between_batches(swap))
        out = original(requests, params, **kwargs)
        events.append("end")
        return out

    monkeypatch.setattr(worker.engine, "generate", generate)
    body = {"messages": [{"role": "user", "content": "count to three"}], "max_tokens": 8}
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: post(url, body), range(12)))
    assert [status for status, _ in results] == [200] * 12
    assert hooks[0].result(timeout=10) is True
    assert events.count("swap") == 1
    at = events.index("swap")
    assert events[at - 1] == "end" and events[at + 1].startswith("start")
    assert sum(int(e.split()[1]) for e in events if e.startswith("start")) == 12  # none dropped, none twice

    def broken(model):
        raise RuntimeError("bad weights")

    with pytest.raises(RuntimeError, match="bad weights"):
        server.between_batches(broken).result(timeout=10)
    assert post(url, body)[0] == 200  # the worker goes on


def _truncated_png() -> str:
    buffer = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()[:2000]).decode()


CORRUPT = _truncated_png()


@pytest.mark.parametrize(
    "body, status, param, message",
    [
        (b'{"messages": [', 400, None, "not valid JSON"),
        ({"max_tokens": 4}, 400, "messages", "is required"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": CORRUPT}}]}]},
            400,
            "messages[0].content[0].image_url",
            "corrupt",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a"},
                            {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}},
                        ],
                    }
                ]
            },
            400,
            "messages[0].content[1].image_url",
            "fetching images over HTTP is off",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]},
            400,
            "messages[0].content[0].image_url",
            "data: URI",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]},
            400,
            "messages[0].content[1].type",
            "input_audio",
        ),
        ({"messages": [{"role": "user", "content": "a"}], "functions": []}, 400, "functions", "unsupported field"),
        ({"messages": [{"role": "tool", "content": "a"}]}, 400, "messages[0].role", "must be one of"),
        (
            {"messages": [{"role": "user", "content": "a"}], "temperature": "hot"},
            400,
            "temperature",
            "must be a number",
        ),
        ({"messages": [{"role": "user", "content": "a"}], "n": BATCH + 1}, 400, "n", "between 1 and 4"),
        ({"messages": [{"role": "user", "content": "a"}], "max_tokens": True}, 400, "max_tokens", "integer"),
        (
            {"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"tokenize": True}},
            400,
            "chat_template_kwargs.tokenize",
            "set by the server",
        ),
        ({"messages": [{"role": "user", "content": "a"}], "model": "gpt-4"}, 404, "model", "does not exist"),
        ([1, 2], 400, None, "JSON object"),
    ],
)
def test_malformed_requests_are_answered_with_the_field_and_the_server_goes_on(served, body, status, param, message):
    _, _, url = served
    got, answer = post(url, None, raw=body) if isinstance(body, bytes) else post(url, body)
    assert got == status
    error = answer["error"]
    assert error["param"] == param and message in error["message"] and "Traceback" not in error["message"]
    assert error["type"] == "invalid_request_error"
    assert get(url, "/health") == (200, {"status": "ok", "weights_step": None})


HI = [{"role": "user", "content": "a"}]


@pytest.mark.parametrize(
    "field, value, param, message",
    [
        # was a 500: Overflow when unpacking long long
        ("seed", 2**70, "seed", "between -9223372036854775808 and 9223372036854775807"),
        ("seed", 2**63, "seed", "between"),
        ("seed", -(2**63) - 1, "seed", "between"),
        # was a 500: probability tensor contains inf/nan
        ("temperature", 1e-300, "temperature", "0 (greedy) or from 0.01"),
        ("temperature", 0.009, "temperature", "0.01"),
        ("temperature", float("inf"), "temperature", "finite"),  # json.dumps writes Infinity, which Python's json reads
        # was accepted
        (
            "stop_token_ids",
            [7, 10**12],
            "stop_token_ids[1]",
            "token id 1000000000000 is outside the model's vocabulary of 1024",
        ),
        ("stop_token_ids", [1024], "stop_token_ids[0]", "outside the model's vocabulary of 1024"),
    ],
)
def test_extreme_sampling_values_are_400s_naming_the_field(served, field, value, param, message):
    """The bounds are vLLM's: a 64-bit seed, a temperature of 0 or at least 0.01, stop token ids inside the
    vocabulary."""
    _, _, url = served
    status, answer = post(url, {"messages": HI, "max_tokens": 1, field: value})
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"
    assert get(url, "/health")[0] == 200


@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", 2**63 - 1),
        ("seed", -(2**63)),
        ("seed", 0),
        ("temperature", 0.01),
        ("temperature", 0),
        ("stop_token_ids", [1023, 1023]),
    ],
)
def test_sampling_values_at_the_bounds_are_served(served, field, value):
    _, _, url = served
    status, answer = post(url, {"messages": HI, "max_tokens": 2, field: value})
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")


def test_health_models_and_routes(served):
    _, _, url = served
    assert get(url, "/v1/models")[1]["data"][0]["id"] == "qwen3_vl-tiny-random"
    assert get(url, "/nope")[0] == 404
    assert get(url, "/v1/chat/completions")[0] == 405
    with Server("127.0.0.1", 0) as bare:  # bound, no model yet: /health says so
        bare.start()
        assert get(bare.url, "/health") == (503, {"status": "loading"})
        assert get(bare.url, "/v1/models")[0] == 503


def test_the_curl_example_in_the_docs_works(served):
    _, _, url = served
    command = re.search(r"```bash\n(curl .*?)\n```", DOCS.read_text(), re.DOTALL).group(1)
    body = json.loads(re.search(r"-d '(.*)'", command, re.DOTALL).group(1))
    status, answer = post(url, body)
    assert status == 200 and len(answer["choices"]) == 2 and answer["prompt_token_ids"]


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_the_cli_prints_the_url_and_serves_until_stopped(tmp_path, stop):
    config = tmp_path / "run.toml"
    config.write_text('[model]\ninit = "random"\nfamily = "qwen3_vl"\n\n[trainer]\ndevice = "cpu"\n')
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "PYTHONFAULTHANDLER": "1"}  # a hang's stacks
    # Ctrl-C as a terminal delivers it: a test run started in the background (`pytest &`, some CI runners) has SIGINT
    # ignored, which its children inherit, and a Python that starts with SIGINT ignored leaves it so (this test then
    # hung, 3 of 5 full runs): the server gets SIGINT's default disposition, as in a foreground shell.
    process = subprocess.Popen(
        [sys.executable, "-m", "vlmreg", "serve", str(config), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        url = None
        for line in process.stdout:
            found = re.search(r"serving qwen3_vl-tiny-random at (http://127\.0\.0\.1:\d+)/v1", line)
            if found:
                url = found.group(1)
                break
        assert url, process.stderr.read()
        assert get(url, "/health") == (200, {"status": "ok", "weights_step": None})
        status, body = post(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
        process.send_signal(stop)
        try:
            process.wait(timeout=60)  # 1.5 s
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)  # with PYTHONFAULTHANDLER: every thread's stack on stderr
            _, err = process.communicate(timeout=30)
            pytest.fail(f"vlmreg serve did not exit within 60 s of {stop.name}; its stderr ends:\n{err[-6000:]}")
        assert process.returncode == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
