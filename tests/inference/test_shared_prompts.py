"""`[rollout] share_prompts`: a GRPO group's identical conversations go to a real `vlmreg serve` as one request with
``n`` = the group's size; the turns come back in the callers' order, each with the processor's own prompt ids and the
logprobs of a plain forward. Requests are counted by the server's own access log; a proxy in front of the server
alters answers to show that a wrong count or index of choices is an error naming the URL and the group."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler

import pytest
import torch
from PIL import Image

import vlmreg
from tests.http_stub import StubServer, send
from vlmreg.config import ConfigError, parse_config
from vlmreg.data import ImageStore, image_part, text_part
from vlmreg.data.prompts import vision_token_ids
from vlmreg.inference.openai_client import OpenAIEngine, RolloutServerError
from vlmreg.inference.server_pool import ServerPool
from vlmreg.sdk.engine import SamplingParams
from vlmreg.serve import serve_in_thread
from vlmreg.testing.parity import plain_logprobs, processor_inputs

GROUP = 4
MODEL = "qwen3_vl-tiny-random"  # the served model's name
COLOURS = {"a": ("red", "What colour is this?"), "b": ("blue", "Name the colour.")}
ORDER = "aabababb"  # two groups of four, interleaved: each turn must land at its own caller's place


@pytest.fixture(scope="module")
def served():
    torch.manual_seed(0)
    config = {
        "model": {"init": "random", "family": "qwen3_vl"},
        "trainer": {"device": "cpu"},
        "rollout": {"max_concurrent_rollouts": 8},
    }
    loaded = vlmreg.load(parse_config(config))
    access: list[str] = []
    server, url = serve_in_thread(loaded, log=access.append)
    yield loaded, url, access
    server.close()


def posts(access: list[str]) -> int:
    """Chat requests in the server's access log."""
    return sum('"POST /v1/chat/completions' in line for line in access)


class Proxy:
    """An HTTP proxy in front of the server: it records each chat request's ``n`` and each answer as the server gave
    it, then hands the client ``alter(answer)`` (``None``: unchanged), or a 503 for the first ``fail_first``
    requests."""

    def __init__(self, target: str, alter=None, fail_first: int = 0):
        self.target, self.alter, self.fail_first = target, alter, fail_first
        self.sent: list[int] = []
        self.answers: list[dict] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                with proxy.lock:
                    proxy.sent.append(json.loads(raw)["n"])
                    failing = proxy.fail_first > 0
                    proxy.fail_first -= failing
                if failing:
                    status, data = 503, json.dumps({"error": {"message": "busy"}}).encode()
                else:
                    request = urllib.request.Request(
                        proxy.target + self.path, data=raw, headers={"Content-Type": "application/json"}
                    )
                    try:
                        with urllib.request.urlopen(request, timeout=60) as response:
                            answer = json.loads(response.read())
                    except urllib.error.HTTPError as exc:  # the server's refusal, passed on as it is
                        status, data = exc.code, exc.read()
                    else:
                        proxy.answers.append(answer)
                        status, data = 200, json.dumps(proxy.alter(answer) if proxy.alter else answer).encode()
                send(self, status, data)

        self.server = StubServer(Handler)
        self.url = self.server.url

    def close(self):
        self.server.close()


def workload(store: ImageStore, order: str = ORDER) -> tuple[list[list[dict]], list[list[dict]], list[str]]:
    """The conversations by image id (for the engine), the same with PIL images (for the processor), and their names."""
    images = {k: Image.new("RGB", (64, 64), colour) for k, (colour, _) in COLOURS.items()}
    ids = {k: store.add(image) for k, image in images.items()}
    by_id = [[{"role": "user", "content": [image_part(ids[k]), text_part(COLOURS[k][1])]}] for k in order]
    pil = [
        [{"role": "user", "content": [{"type": "image", "image": images[k]}, text_part(COLOURS[k][1])]}] for k in order
    ]
    return by_id, pil, [f"example {k}" for k in order]


def params(loaded) -> SamplingParams:
    eos = loaded.processor.tokenizer.eos_token_id
    return SamplingParams(
        temperature=1.0,
        max_tokens=6,
        stop_token_ids=(eos,),
        suppress_token_ids=vision_token_ids(loaded.processor, loaded.resolved.descriptor),
    )


def test_two_groups_of_four_are_two_requests_and_eight_turns_in_the_callers_order(served):
    loaded, url, access = served
    store = ImageStore()
    conversations, pil, names = workload(store)
    # the proxy hands the choices back in reverse: the engine must place them by their index, not their position
    proxy = Proxy(url, alter=lambda answer: {**answer, "choices": answer["choices"][::-1]})
    try:
        before = posts(access)
        turns = OpenAIEngine(proxy.url, loaded.processor, store, model=MODEL).chat(
            conversations, params(loaded), names=names
        )
        assert posts(access) - before == 2 and sorted(proxy.sent) == [GROUP, GROUP]
    finally:
        proxy.close()
    assert len(turns) == len(ORDER)
    suppress = list(vision_token_ids(loaded.processor, loaded.resolved.descriptor))
    for turn, conversation in zip(turns, pil, strict=True):
        assert turn.prompt.input_ids == processor_inputs(loaded.processor, conversation)["input_ids"][0].tolist()
        ids = turn.completion.token_ids
        assert turn.completion.finish_reason == (
            "stop" if ids[-1] == loaded.processor.tokenizer.eos_token_id else "length"
        )
        reference = plain_logprobs(loaded.model, loaded.processor, conversation, ids, suppress)
        assert torch.allclose(torch.tensor(turn.completion.logprobs), reference, atol=1e-4)
    # each caller's turn is the choice of its rank in the group (by index), from the server's answer
    for key in COLOURS:
        places = [i for i, k in enumerate(ORDER) if k == key]
        answer = next(a for a in proxy.answers if a["prompt_token_ids"] == turns[places[0]].prompt.input_ids)
        by_index = {c["index"]: c["token_ids"] for c in answer["choices"]}
        assert [turns[i].completion.token_ids for i in places] == [by_index[j] for j in range(GROUP)]
        assert len({tuple(turns[i].completion.token_ids) for i in places}) > 1  # n samples, not one sample n times
    assert turns[0].prompt is not turns[1].prompt  # each turn its own prompt object, as its own request gave


def test_share_prompts_off_sends_one_request_per_conversation(served):
    loaded, url, access = served
    store = ImageStore()
    conversations, pil, names = workload(store)
    before = posts(access)
    turns = OpenAIEngine(url, loaded.processor, store, model=MODEL, share_prompts=False).chat(
        conversations, params(loaded), names=names
    )
    assert posts(access) - before == 8
    assert [t.prompt.input_ids for t in turns] == [
        processor_inputs(loaded.processor, c)["input_ids"][0].tolist() for c in pil
    ]


def test_a_group_larger_than_max_concurrent_is_split_and_a_retry_resends_the_whole_request(served):
    loaded, url, access = served
    store = ImageStore()
    conversations, _, names = workload(store)
    proxy = Proxy(url, fail_first=1)  # the first request gets a 503 and is sent again, whole
    try:
        before = posts(access)
        turns = OpenAIEngine(proxy.url, loaded.processor, store, model=MODEL, max_concurrent=3, backoff_s=0.01).chat(
            conversations, params(loaded), names=names
        )
        assert posts(access) - before == 4 and sorted(proxy.sent[1:]) == [1, 1, 3, 3] and proxy.sent[0] in (1, 3)
    finally:
        proxy.close()
    assert len(turns) == 8 and all(len(t.completion.token_ids) == len(t.completion.logprobs) > 0 for t in turns)


@pytest.mark.parametrize(
    ("alter", "message"),
    [
        (lambda a: {**a, "choices": a["choices"][:-1]}, r"asked for n = 4 completions, the answer holds 3 choice\(s\)"),
        (
            lambda a: {**a, "choices": [{**c, "index": min(c["index"], 2)} for c in a["choices"]]},
            r"the n = 4 choices. index values are \[0, 1, 2, 2\], not 0 to 3 once each",
        ),
    ],
)
def test_an_answer_with_the_wrong_choices_is_an_error_naming_the_url_and_the_group(served, alter, message):
    loaded, url, _ = served
    store = ImageStore()
    conversations, _, names = workload(store, "aaaa")
    proxy = Proxy(url, alter=alter)
    try:
        engine = OpenAIEngine(proxy.url, loaded.processor, store, model=MODEL)
        with pytest.raises(
            RolloutServerError,
            match=re.escape(f"{proxy.url}: example a (n = 4): ") + message + r".*share_prompts = false",
        ):
            engine.chat(conversations, params(loaded), names=names)
    finally:
        proxy.close()


def test_several_servers_share_within_each_and_count_completions(served):
    """`ServerPool` gives each group to one server; that server's engine sends it as one request, and the pool counts
    the group's completions, not the requests."""
    loaded, url, access = served
    store = ImageStore()
    conversations, _, names = workload(store)
    proxies = [Proxy(url), Proxy(url)]
    try:
        pool = ServerPool(
            [OpenAIEngine(p.url, loaded.processor, store, model=MODEL) for p in proxies], [p.url for p in proxies]
        )
        before = posts(access)
        turns = pool.chat(conversations, params(loaded), names=names)
        assert [p.sent for p in proxies] == [[GROUP], [GROUP]] and posts(access) - before == 2
        assert pool.completions == [GROUP, GROUP] and len(turns) == 8
    finally:
        for proxy in proxies:
            proxy.close()


def test_the_setting_reaches_the_engine():
    base = {"model": {"init": "random", "family": "qwen3_vl"}, "broadcast": {"transport": "filesystem"}}
    for value in (True, False):
        rollout = parse_config(
            {**base, "rollout": {"engine": "openai", "url": "http://h:1", "share_prompts": value}}
        ).rollout
        assert OpenAIEngine.from_config(rollout, processor=None, store=ImageStore()).share_prompts is value
    assert parse_config({**base, "rollout": {"engine": "openai", "url": "http://h:1"}}).rollout.share_prompts is True
    with pytest.raises(ConfigError, match=r"rollout\.share_prompts"):
        parse_config({**base, "rollout": {"engine": "openai", "url": "http://h:1", "share_prompts": "yes"}})
