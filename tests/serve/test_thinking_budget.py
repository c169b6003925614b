"""``thinking_token_budget`` (vLLM's request field) on a real `vlmreg serve`, and the `OpenAIEngine` that sends it.

The served model is the tiny Qwen3.5, whose chat template opens ``<think>`` in the generation prompt when thinking
is on. Every expectation is counted off the tokenizer alone: the thinking tokens after the prompt's last ``<think>``
up to the completion's ``</think>``, each marker the tokenizer's own single-token encoding (as vLLM's
``--reasoning-config`` encodes it). A family without thinking markers (Qwen2.5-VL) refuses the field with a 400.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

import vlmreg
from tests.inference.test_openai_client import Stub, answer
from vlmreg.config import parse_config
from vlmreg.data import ImageStore
from vlmreg.inference.openai_client import OpenAIEngine, RolloutServerError
from vlmreg.sdk.engine import SamplingParams
from vlmreg.serve import serve_in_thread

BUDGET = 3
THINK = {"enable_thinking": True}


def serve(family: str):
    torch.manual_seed(0)
    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": family}, "trainer": {"device": "cpu"}}))
    server, url = serve_in_thread(loaded)
    return loaded, server, url


@pytest.fixture(scope="module")
def qwen3_5():
    loaded, server, url = serve("qwen3_5")
    yield loaded, url
    server.close()


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def markers(tokenizer) -> tuple[int, int]:
    [start] = tokenizer.encode("<think>", add_special_tokens=False)
    [end] = tokenizer.encode("</think>", add_special_tokens=False)
    return start, end


def thinking(tokenizer, prompt_ids: list[int], token_ids: list[int]) -> tuple[int, int | None]:
    """The thinking tokens (after the prompt's last ``<think>``, up to the completion's first ``</think>``) and where
    in the completion that ``</think>`` stands (``None``: not written)."""
    start, end = markers(tokenizer)
    opened = len(prompt_ids) - 1 - prompt_ids[::-1].index(start)
    closed = token_ids.index(end) if end in token_ids else None
    return len(prompt_ids) - opened - 1 + (len(token_ids) if closed is None else closed), closed


def request(n: int = 6, **fields) -> dict:
    return {
        "messages": [{"role": "user", "content": "How many?"}],
        "n": n,
        "max_tokens": 10,
        "seed": 7,
        "logprobs": True,
        "return_token_ids": True,
        "chat_template_kwargs": THINK,
        **fields,
    }


def test_the_server_ends_each_choices_thinking_after_the_budget(qwen3_5):
    loaded, url = qwen3_5
    tokenizer = loaded.processor.tokenizer
    status, free = post(url, request())
    assert status == 200
    status, capped = post(url, request(thinking_token_budget=BUDGET))
    assert status == 200
    prompt = capped["prompt_token_ids"]
    assert prompt == free["prompt_token_ids"] and tokenizer.decode(prompt).endswith("<think>\n")
    held, _ = thinking(tokenizer, prompt, [])  # the newline after <think>: a thinking token already
    hits = 0
    for plain, cut in zip(free["choices"], capped["choices"], strict=True):
        ids, logprobs = cut["token_ids"], [e["logprob"] for e in cut["logprobs"]["content"]]
        count, closed = thinking(tokenizer, prompt, ids)
        sampled = BUDGET - held  # what the budget lets the model sample before the marker
        assert ids[:sampled] == plain["token_ids"][:sampled]  # the same seed: nothing differs before the budget
        assert count <= BUDGET
        free_count, _ = thinking(tokenizer, prompt, plain["token_ids"])
        if free_count > BUDGET:  # the model would have thought longer: the budget wrote the marker, as a point mass
            assert closed == sampled and count == BUDGET and logprobs[closed] == 0.0
            hits += 1
        else:
            assert ids == plain["token_ids"]
    assert hits >= 4
    status, unlimited = post(url, request(thinking_token_budget=-1))  # vLLM's "no budget"
    assert status == 200 and [c["token_ids"] for c in unlimited["choices"]] == [c["token_ids"] for c in free["choices"]]


@pytest.mark.parametrize("value", [-2, 1.5, True, "3"])
def test_a_budget_that_is_not_a_count_is_a_400_naming_the_field(qwen3_5, value):
    _, url = qwen3_5
    status, body = post(url, request(thinking_token_budget=value))
    assert status == 400 and body["error"]["param"] == "thinking_token_budget"
    assert "must be an integer >= 0, or -1 for no budget" in body["error"]["message"]


def test_a_family_without_thinking_markers_refuses_the_budget():
    loaded, server, url = serve("qwen2_5_vl")
    try:
        assert loaded.resolved.descriptor.thinking_end is None
        body = request(n=1)
        del body["chat_template_kwargs"]
        assert post(url, body)[0] == 200
        status, answer_ = post(url, {**body, "thinking_token_budget": 4})
    finally:
        server.close()
    assert status == 400 and answer_["error"]["param"] == "thinking_token_budget"
    assert (
        "family (qwen2_5_vl) declares no thinking markers (thinking_start, thinking_end)" in answer_["error"]["message"]
    )


def test_the_openai_engine_sends_the_budget_and_counts_the_completions_it_cut(qwen3_5):
    loaded, url = qwen3_5
    tokenizer = loaded.processor.tokenizer
    engine = OpenAIEngine(url, loaded.processor, ImageStore(), descriptor=loaded.resolved.descriptor)
    torch.manual_seed(3)
    conversation = [{"role": "user", "content": "How many?"}]
    turns = engine.chat(
        [conversation] * 8, SamplingParams(max_tokens=10, thinking_budget=BUDGET), template_kwargs=THINK
    )
    for turn in turns:
        count, closed = thinking(tokenizer, turn.prompt.input_ids, turn.completion.token_ids)
        assert count <= BUDGET
        cut = closed is not None and count == BUDGET and turn.completion.logprobs[closed] == 0.0
        assert turn.completion.thinking_forced == cut
    assert sum(t.completion.thinking_forced for t in turns) >= 4
    free = engine.chat([conversation] * 4, SamplingParams(max_tokens=10), template_kwargs=THINK)
    assert not any(t.completion.thinking_forced for t in free)


def test_the_openai_engine_keeps_every_forced_marker_of_a_completion_that_thinks_again(qwen3_5):
    """Every token but ``<think>`` suppressed (a logit bias of -100 in the request): after each forced ``</think>`` the
    model opens a new block, which the server ends in turn. Each ``</think>`` (the tokenizer's id) is the server's
    token, drawn from a point mass: ``Completion.forced`` must list them all, not only the first (a random init's
    -log p(</think>), about 7 nats, would otherwise count in ``mismatch_kl``)."""
    loaded, url = qwen3_5
    start, end = markers(loaded.processor.tokenizer)
    engine = OpenAIEngine(url, loaded.processor, ImageStore(), descriptor=loaded.resolved.descriptor)
    others = tuple(t for t in range(loaded.model.config.text_config.vocab_size) if t != start)
    params = SamplingParams(max_tokens=10, suppress_token_ids=others, thinking_budget=2)
    for turn in engine.chat([[{"role": "user", "content": "How many?"}]] * 2, params, template_kwargs=THINK):
        c = turn.completion
        # the prompt's newline and one <think>, then 2 after each <think> the model opens
        assert c.token_ids == [start, end, start, start, start, end, start, start, start, end]
        ends = tuple(i for i, t in enumerate(c.token_ids) if t == end)
        assert c.thinking_forced and c.forced == ends and all(c.logprobs[i] == 0.0 for i in ends)


def test_the_request_carries_the_field_only_when_a_budget_is_set(qwen3_5):
    loaded, _ = qwen3_5
    stub = Stub([(200, answer([10, 11, 12], [40, 41]))])
    try:
        engine = OpenAIEngine(
            stub.url, loaded.processor, ImageStore(), model="m", descriptor=loaded.resolved.descriptor
        )
        conversation = [{"role": "user", "content": "hi"}]
        engine.chat([conversation], SamplingParams(max_tokens=2))
        engine.chat([conversation], SamplingParams(max_tokens=2, thinking_budget=5))
    finally:
        stub.close()
    without, with_budget = stub.requests
    assert "thinking_token_budget" not in without and with_budget["thinking_token_budget"] == 5


def test_a_vllm_started_without_the_reasoning_config_is_an_error_that_gives_the_flag(qwen3_5):
    loaded, _ = qwen3_5
    refusal = (
        "thinking_token_budget is set but reasoning_config is not configured. Please set --reasoning-parser and/or "
        # vLLM 0.24's words (vllm/v1/engine/input_processor.py)
        "--reasoning-config to use thinking_token_budget."
    )
    stub = Stub([(400, {"error": {"message": refusal, "type": "BadRequestError", "param": None, "code": 400}})])
    try:
        engine = OpenAIEngine(
            stub.url, loaded.processor, ImageStore(), model="m", descriptor=loaded.resolved.descriptor
        )
        with pytest.raises(RolloutServerError) as caught:
            engine.chat([[{"role": "user", "content": "hi"}]], SamplingParams(max_tokens=2, thinking_budget=5))
    finally:
        stub.close()
    flag = str(caught.value).split("--reasoning-config '")[-1].split("'")[0]
    assert refusal in str(caught.value) and json.loads(flag) == {
        "reasoning_start_str": "<think>",
        "reasoning_end_str": "</think>",
    }
