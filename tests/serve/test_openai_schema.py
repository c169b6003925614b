"""`vlmreg serve` driven by the official ``openai`` client: every field the client sends is honoured or refused clearly.

Each expectation is computed independently of the server: decoded text with the tokenizer, logprobs and their
top-k alternatives from a plain forward of the model on the processor's own inputs, token bytes through GPT-2's
byte table as transformers writes it.
"""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image

import vlmreg
from vlmreg.config import parse_config
from vlmreg.data.prompts import vision_token_ids
from vlmreg.serve import serve_in_thread
from vlmreg.testing.parity import processor_inputs

openai = pytest.importorskip("openai")
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

BATCH = 8
MODEL = "qwen3_vl-tiny-random"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


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
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)  # the server takes no key
    yield loaded, server, url, client
    client.close()
    server.close()


def png_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def text_message(text: str = "say something") -> dict:
    return {"role": "user", "content": text}


def image_conversation(colour: str) -> tuple[list[dict], list[dict]]:
    """The same user turn as the client sends it and as the processor takes it."""
    image = Image.new("RGB", (64, 64), colour)
    sent = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": png_uri(image)}},
                {"type": "text", "text": "What colour?"},
            ],
        }
    ]
    local = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What colour?"}]}]
    return sent, local


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def token_ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


class Bytes:
    """Each token's bytes, independently: GPT-2's byte table (transformers' copy) over the vocabulary's pieces."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoder = {c: b for b, c in bytes_to_unicode().items()}
        self.encoder = bytes_to_unicode()
        self.added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}

    def __call__(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        return bytes(self.decoder[c] for c in self.tokenizer.convert_ids_to_tokens(token_id))

    def id_of_byte(self, byte: int) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.encoder[byte])


def reference_logprobs(loaded, conversation, ids, *, temperature=1.0, bias=None, frequency=0.0, presence=0.0):
    """log-softmax of the distribution each completion token was sampled from: a plain forward on the processor's
    inputs, the vision tokens suppressed, then bias and penalties as OpenAI defines them, then temperature."""
    inputs = processor_inputs(loaded.processor, conversation, ids)
    prompt = inputs["input_ids"].shape[1] - len(ids)
    with torch.no_grad():
        logits = loaded.model(**inputs, use_cache=False).logits[0, prompt - 1 : -1].float()
    logits[:, list(vision_token_ids(loaded.processor, loaded.resolved.descriptor))] = float("-inf")
    for token, value in (bias or {}).items():
        logits[:, token] += value
    counts = torch.zeros_like(logits)
    for t in range(1, len(ids)):
        counts[t] = counts[t - 1]
        counts[t, ids[t - 1]] += 1
    logits = logits - frequency * counts - presence * (counts > 0).float()
    return torch.log_softmax(logits / temperature, -1)


def check_logprobs_and_top(choice, ids, expected, token_bytes, k):
    """The sampled tokens' logprobs, and the top-k alternatives (as bytes) with theirs, against the reference."""
    by_bytes = {token_bytes(i): i for i in range(len(token_bytes.tokenizer))}
    content = choice.logprobs.content
    assert [e.bytes for e in content] == [list(token_bytes(t)) for t in ids]
    assert torch.allclose(
        torch.tensor([e.logprob for e in content]),
        expected.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1),
        atol=1e-4,
    )
    for position, entry in enumerate(content):
        alternatives = entry.top_logprobs
        assert len(alternatives) == k
        kth = expected[position].topk(k).values[-1].item()
        values = [a.logprob for a in alternatives]
        assert values == sorted(values, reverse=True)
        for alternative in alternatives:
            token = by_bytes[bytes(alternative.bytes)]
            assert abs(alternative.logprob - expected[position, token].item()) < 1e-4
            assert expected[position, token].item() >= kth - 1e-4  # within the reference's top k (ties allowed)
            assert alternative.token == token_bytes.tokenizer.decode([token])


# -- stop strings --------------------------------------------------------------------------------
def test_a_stop_string_cuts_the_text_and_the_tokens_end_at_the_one_that_completed_it(served):
    loaded, _, _, client = served
    decode = loaded.processor.tokenizer.decode
    messages = [text_message("tell me a story")]
    full = chat(
        client, messages, temperature=0, max_tokens=16, logprobs=True, extra_body={"return_token_ids": True}
    ).choices[0]
    text, ids = full.message.content, token_ids_of(full)
    assert full.finish_reason == "length" and len(text) > 8
    stop = text[5:7]
    cut = text[: text.find(stop)]
    for form in (stop, ["never appears", stop]):
        choice = chat(
            client,
            messages,
            temperature=0,
            max_tokens=16,
            stop=form,
            logprobs=True,
            extra_body={"return_token_ids": True},
        ).choices[0]
        got = token_ids_of(choice)
        assert choice.message.content == cut and choice.finish_reason == "stop"
        # every sampled token up to the one whose text completed the stop string, nothing after
        end = next(m for m in range(1, len(ids) + 1) if stop in decode(ids[:m], skip_special_tokens=True))
        assert got == ids[:end]
        assert [e.logprob for e in choice.logprobs.content] == [e.logprob for e in full.logprobs.content[:end]]
    missed = chat(client, messages, temperature=0, max_tokens=16, stop=["never appears"]).choices[0]
    assert missed.message.content == text and missed.finish_reason == "length"
    assert chat(client, messages, temperature=0, max_tokens=16, stop=None).choices[0].message.content == text


# -- logprobs: top alternatives, bytes, bias and penalties ----------------------------------------------
def test_top_logprobs_are_the_top_k_of_the_distribution_sampled_from(served):
    loaded, _, _, client = served
    sent, local = image_conversation("red")
    temperature, k = 0.7, 5
    answer = chat(
        client,
        sent,
        n=2,
        temperature=temperature,
        max_tokens=6,
        logprobs=True,
        top_logprobs=k,
        extra_body={"return_token_ids": True},
    )
    token_bytes = Bytes(loaded.processor.tokenizer)
    for choice in answer.choices:
        ids = token_ids_of(choice)
        expected = reference_logprobs(loaded, local, ids, temperature=temperature)
        check_logprobs_and_top(choice, ids, expected, token_bytes, k)
    plain = chat(client, sent, max_tokens=3, logprobs=True).choices[0]
    assert all(e.top_logprobs == [] for e in plain.logprobs.content)


def test_logit_bias_and_penalties_shape_the_distribution_the_logprobs_come_from(served):
    loaded, _, _, client = served
    sent, local = image_conversation("blue")
    tokenizer = loaded.processor.tokenizer
    favoured, banned = tokenizer.convert_tokens_to_ids("Ġthe"), tokenizer.convert_tokens_to_ids("er")
    bias = {favoured: 4.0, banned: -100.0}
    settings = {"temperature": 0.9, "frequency_penalty": 0.8, "presence_penalty": 0.5}
    answer = chat(
        client,
        sent,
        n=4,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        logit_bias={str(t): v for t, v in bias.items()},
        extra_body={"return_token_ids": True},
        **settings,
    )
    token_bytes = Bytes(tokenizer)
    for choice in answer.choices:
        ids = token_ids_of(choice)
        expected = reference_logprobs(loaded, local, ids, bias=bias, frequency=0.8, presence=0.5, temperature=0.9)
        check_logprobs_and_top(choice, ids, expected, token_bytes, 3)
        assert banned not in ids


def test_logit_bias_changes_what_is_sampled(served):
    loaded, _, _, client = served
    messages = [text_message("hello")]
    greedy = token_ids_of(
        chat(client, messages, temperature=0, max_tokens=4, extra_body={"return_token_ids": True}).choices[0]
    )
    avoided = token_ids_of(
        chat(
            client,
            messages,
            temperature=0,
            max_tokens=4,
            logit_bias={str(greedy[0]): -100},
            extra_body={"return_token_ids": True},
        ).choices[0]
    )
    assert avoided[0] != greedy[0]
    forced = loaded.processor.tokenizer.convert_tokens_to_ids("Ġthe")
    for choice in chat(
        client, messages, n=3, max_tokens=5, logit_bias={str(forced): 100}, extra_body={"return_token_ids": True}
    ).choices:
        assert token_ids_of(choice) == [forced] * 5


def test_token_bytes_are_exact_for_partial_utf8_tokens(served):
    loaded, _, _, client = served
    token_bytes = Bytes(loaded.processor.tokenizer)
    # "é" is C3 A9: alone, each is half a character
    lead, tail = token_bytes.id_of_byte(0xC3), token_bytes.id_of_byte(0xA9)
    choice = chat(
        client,
        [text_message()],
        max_tokens=12,
        seed=3,
        logprobs=True,
        top_logprobs=20,
        logit_bias={str(lead): 30, str(tail): 30},
        extra_body={"return_token_ids": True},
    ).choices[0]
    ids = token_ids_of(choice)
    assert set(ids) <= {lead, tail} and {lead, tail} <= set(ids)
    assert [bytes(e.bytes) for e in choice.logprobs.content] == [token_bytes(t) for t in ids]
    assert (
        b"".join(bytes(e.bytes) for e in choice.logprobs.content).decode("utf-8", errors="replace")
        == choice.message.content
    )
    by_bytes = {token_bytes(i): i for i in range(len(loaded.processor.tokenizer))}
    alternatives = [a for e in choice.logprobs.content for a in e.top_logprobs]
    assert len(alternatives) == 20 * len(ids) and {lead, tail} <= {by_bytes[bytes(a.bytes)] for a in alternatives}
    assert all(a.token == loaded.processor.tokenizer.decode([by_bytes[bytes(a.bytes)]]) for a in alternatives)


# -- accepted and refused fields -------------------------------------------------------------------
def test_neutral_values_the_client_sends_are_accepted(served):
    _, _, _, client = served
    answer = chat(
        client,
        [text_message()],
        max_tokens=2,
        stop=None,
        frequency_penalty=0,
        presence_penalty=0,
        logit_bias={},
        response_format={"type": "text"},
        top_logprobs=0,
        logprobs=False,
        stream=False,
        user="someone",
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    raw = {
        "messages": [text_message()],
        "max_tokens": 2,
        "frequency_penalty": None,
        "presence_penalty": None,
        "logit_bias": None,
        "response_format": None,
    }
    request = urllib.request.Request(
        served[2] + "/v1/chat/completions", data=json.dumps(raw).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        ({"response_format": {"type": "json_object"}}, "response_format", "no constrained decoding"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
            "response_format",
            "no constrained decoding",
        ),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
        ({"logit_bias": {"1024": 1}}, "logit_bias.1024", "outside the model's vocabulary"),
        ({"logit_bias": {"7": 101}}, "logit_bias.7", "between -100 and 100"),
        ({"logit_bias": {"the": 1}}, "logit_bias.the", "decimal strings"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"stop": ""}, "stop", "empty stop string"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "between -2 and 2"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported field"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_field(served, kwargs, param, message):
    _, _, _, client = served
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, [text_message()], max_tokens=2, **kwargs)
    assert caught.value.param == param and message in caught.value.message


def test_developer_is_system_and_assistant_content_may_be_null(served):
    loaded, _, _, client = served
    extra = {"return_token_ids": True}
    developer = chat(
        client, [{"role": "developer", "content": "be brief"}, text_message()], max_tokens=1, extra_body=extra
    )
    expected = processor_inputs(loaded.processor, [{"role": "system", "content": "be brief"}, text_message()])[
        "input_ids"
    ][0].tolist()
    assert developer.model_extra["prompt_token_ids"] == expected
    turns = [
        text_message("hi"),
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": None},
        text_message("again"),
    ]
    empty = [text_message("hi"), {"role": "assistant", "content": ""}, text_message("again")]
    got = chat(client, turns, max_tokens=1, extra_body=extra).model_extra["prompt_token_ids"]
    assert got == processor_inputs(loaded.processor, empty)["input_ids"][0].tolist()
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, [{"role": "user", "content": None}], max_tokens=1)
    assert caught.value.param == "messages[0].content"


def test_models_list_and_retrieve(served):
    _, _, _, client = served
    assert [m.id for m in client.models.list()] == [MODEL]
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.code == "model_not_found" and caught.value.param == "model"


# -- streaming ----------------------------------------------------------------------------------------
def test_a_stream_carries_the_same_answer_as_chunks(served):
    _, _, _, client = served
    messages = [text_message("tell me a story")]
    whole = chat(client, messages, temperature=0, max_tokens=16, logprobs=True)
    text = whole.choices[0].message.content
    stop = text[6:8]
    for kwargs in ({}, {"stop": stop}):
        expected = chat(
            client,
            messages,
            temperature=0,
            max_tokens=16,
            logprobs=True,
            extra_body={"return_token_ids": True},
            **kwargs,
        )
        stream = chat(
            client,
            messages,
            temperature=0,
            max_tokens=16,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
            **kwargs,
        )
        chunks = list(stream)
        assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
        assert chunks[0].choices[0].delta.role == "assistant"
        body = [c for c in chunks if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in body) == expected.choices[0].message.content
        assert [e for c in body if c.choices[0].logprobs for e in c.choices[0].logprobs.content] == expected.choices[
            0
        ].logprobs.content
        assert [t for c in body for t in c.choices[0].model_extra.get("token_ids", [])] == token_ids_of(
            expected.choices[0]
        )
        assert body[-1].choices[0].finish_reason == expected.choices[0].finish_reason
        assert (
            all(c.usage is None for c in chunks[:-1])
            and chunks[-1].choices == []
            and chunks[-1].usage == expected.usage
        )
    assert chunks[0].model_extra["prompt_token_ids"] == expected.model_extra["prompt_token_ids"]


def test_a_stream_of_partial_characters_and_several_choices(served):
    loaded, _, _, client = served
    token_bytes = Bytes(loaded.processor.tokenizer)
    bias = {
        str(token_bytes.id_of_byte(0xC3)): 30,
        str(token_bytes.id_of_byte(0xA9)): 30,
        str(token_bytes.id_of_byte(0x61)): 30,
    }
    settings = {"n": 3, "max_tokens": 10, "seed": 11, "logit_bias": bias}
    expected = chat(client, [text_message()], **settings).choices
    chunks = list(chat(client, [text_message()], stream=True, **settings))
    assert all(c.usage is None for c in chunks)
    for choice in expected:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [c.finish_reason for c in mine][-1] == choice.finish_reason
    assert any("é" in c.message.content for c in expected) and any("\ufffd" in c.message.content for c in expected)


def test_the_stream_is_server_sent_events_on_the_wire(served):
    url = served[2]
    body = {"messages": [text_message()], "max_tokens": 3, "stream": True}
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2]) and chunks[-1]["choices"][0]["finish_reason"] in (
        "stop",
        "length",
    )


# -- load: queued, not reset; refused clearly when truly over capacity --------------------------------
def test_256_concurrent_clients_are_all_answered(served):
    _, server, _, client = served
    server.worker.largest_batch = 0
    start = time.perf_counter()
    with ThreadPoolExecutor(256) as pool:
        answers = list(pool.map(lambda i: chat(client, [text_message(f"request {i}")], max_tokens=2), range(256)))
    elapsed = time.perf_counter() - start
    assert len(answers) == 256 and all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
    assert server.worker.largest_batch == BATCH
    print(f"256 concurrent requests answered in {elapsed:.2f} s")


def test_past_capacity_a_request_is_a_503_not_a_reset(served):
    _, server, url, client = served
    worker = server.worker
    gate = threading.Event()
    held = server.between_batches(lambda model: gate.wait(20))
    worker.max_queued = 2
    try:
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(chat, client, [text_message()], max_tokens=2) for _ in range(2)]
            deadline = time.monotonic() + 30
            while worker.pending < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert worker.pending == 2
            with pytest.raises(openai.InternalServerError) as caught:
                chat(client, [text_message()], max_tokens=2)
            assert caught.value.status_code == 503 and "at capacity" in caught.value.message
            assert caught.value.response.headers["Retry-After"] == "1"
            gate.set()
            assert all(f.result().choices for f in waiting)
    finally:
        worker.max_queued = 4096
        gate.set()
    assert held.result(timeout=10) is True
    admission = server.admission
    admission.max_connections = 1
    try:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10):  # holds the one connection
            time.sleep(0.2)
            with pytest.raises(openai.InternalServerError) as caught:
                chat(client, [text_message()], max_tokens=2)
        assert "1 connections are open" in caught.value.message
    finally:
        admission.max_connections = 1024


def test_a_client_that_stops_sending_is_dropped_after_the_read_timeout(served):
    _, server, url, _ = served
    host, port = url.removeprefix("http://").split(":")
    server.read_timeout_s = 0.5
    try:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                b"100\r\n\r\n{"
            )
            start = time.perf_counter()
            assert sock.recv(1024) == b""  # closed by the server, no answer owed
            assert time.perf_counter() - start < 5
    finally:
        server.read_timeout_s = 60.0
    assert chat(served[3], [text_message()], max_tokens=1).choices


def test_the_python_example_in_the_docs_works(served):
    url = served[2]
    code = re.search(r"```python\n(import openai\n.*?)```", DOCS.read_text(), re.DOTALL).group(1)
    scope: dict = {}
    exec(code.replace("http://127.0.0.1:8000", url), scope)
    assert (
        scope["ids"]
        and scope["answer"].choices[0].finish_reason in ("stop", "length")
        and isinstance(scope["text"], str)
    )
