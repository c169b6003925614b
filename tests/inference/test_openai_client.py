"""`OpenAIEngine` against a real `vlmreg serve` (same prompts and greedy answers as the embedded engine) and stubs
(retries on 5xx, none on 4xx, a clear error for a dead server or a server that disagrees on the processor)."""

from __future__ import annotations

import json
import math
import socket
from http.server import BaseHTTPRequestHandler

import pytest
import torch
from PIL import Image

import vlmreg
from tests.http_stub import StubServer, send
from vlmreg.config import ConfigError, parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.data import ImageStore, image_part, text_part
from vlmreg.data.prompts import vision_token_ids
from vlmreg.inference.cache_scope import CacheScope
from vlmreg.inference.embedded import EmbeddedEngine
from vlmreg.inference.openai_client import OpenAIEngine, RolloutServerError, base_url
from vlmreg.sdk.engine import SamplingParams
from vlmreg.serve import serve_in_thread

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def served():
    torch.manual_seed(0)
    loaded = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}})
    )
    server, url = serve_in_thread(loaded)
    yield loaded, url
    server.close()


def conversations(store: ImageStore) -> list[list[dict]]:
    red, blue = (store.add(Image.new("RGB", (64, 64), c)) for c in ("red", "blue"))
    wide = store.add(Image.new("RGB", (96, 48), "green"))
    return [
        [{"role": "user", "content": [image_part(red), text_part("What colour?")]}],
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "text only"}],
        [
            {"role": "user", "content": [image_part(blue), text_part("colour?")]},
            {"role": "assistant", "content": "Blue"},
            {"role": "user", "content": [image_part(wide), image_part(red), text_part("and these?")]},
        ],
    ]


def params(loaded, **kwargs) -> SamplingParams:
    eos = loaded.processor.tokenizer.eos_token_id
    return SamplingParams(
        max_tokens=6,
        stop_token_ids=(eos,),
        suppress_token_ids=vision_token_ids(loaded.processor, loaded.resolved.descriptor),
        **kwargs,
    )


def test_prompts_and_greedy_answers_equal_the_embedded_engines(served):
    loaded, url = served
    store = ImageStore()
    client = OpenAIEngine(url, loaded.processor, store, max_concurrent=2)
    embedded = EmbeddedEngine(loaded.model, loaded.processor, store, CPU)
    greedy = params(loaded, greedy=True)
    for conversation in conversations(store):  # one at a time: both sides run the same unpadded batch of one
        for kwargs in ({}, {"enable_thinking": True}):
            [remote] = client.chat([conversation], greedy, template_kwargs=kwargs)
            [local] = embedded.chat([conversation], greedy, template_kwargs=kwargs)
            assert remote.prompt == local.prompt  # ids, image ids, per-image token counts and rendered text
            assert remote.completion.token_ids == local.completion.token_ids and remote.text == local.text
            assert remote.completion.finish_reason == local.completion.finish_reason
            assert remote.completion.logprobs == pytest.approx(local.completion.logprobs, abs=1e-4)


def test_sampled_turns_come_back_in_order_with_one_logprob_per_token(served):
    loaded, url = served
    store = ImageStore()
    client = OpenAIEngine(url + "/v1/", loaded.processor, store, max_concurrent=3)
    convs = conversations(store) * 3
    turns = client.chat(convs, params(loaded, temperature=1.0), names=[f"ex:{i}" for i in range(len(convs))])
    assert client.url == url and client.model == "qwen3_vl-tiny-random"
    assert [t.prompt.image_ids for t in turns] == [
        t.prompt.image_ids for t in client.chat(convs, params(loaded, greedy=True))
    ]
    for turn in turns:
        assert len(turn.completion.token_ids) == len(turn.completion.logprobs) > 0
        assert all(math.isfinite(lp) and lp <= 0 for lp in turn.completion.logprobs)
        assert turn.completion.finish_reason in ("stop", "length")


# -- stubs ---------------------------------------------------------------------------------------
class Stub:
    """A tiny HTTP server answering each POST with the next canned (status, body); it records the requests."""

    def __init__(self, answers: list[tuple[int, dict]]):
        self.answers, self.requests = list(answers), []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                stub.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                status, body = stub.answers.pop(0) if len(stub.answers) > 1 else stub.answers[0]
                data = json.dumps(body).encode()
                send(self, status, data)

        self.server = StubServer(Handler)
        self.url = self.server.url

    def close(self):
        self.server.close()


def answer(prompt_ids: list[int], token_ids: list[int]) -> dict:
    content = [{"token": "x", "logprob": -1.0} for _ in token_ids]
    return {
        "prompt_token_ids": prompt_ids,
        "choices": [
            {
                "token_ids": token_ids,
                "logprobs": {"content": content},
                "finish_reason": "length",
                "message": {"content": "x"},
            }
        ],
    }


TEXT_ONLY = [[{"role": "user", "content": "hi"}]]


def test_a_503_is_retried_and_a_400_is_not(served):
    loaded, _ = served
    stub = Stub([(503, {"error": {"message": "busy"}}), (200, answer([10, 11, 12], [40, 41]))])
    try:
        client = OpenAIEngine(stub.url, loaded.processor, ImageStore(), model="m", backoff_s=0.01)
        [turn] = client.chat(TEXT_ONLY, params(loaded))
        assert (
            len(stub.requests) == 2 and turn.prompt.input_ids == [10, 11, 12] and turn.completion.token_ids == [40, 41]
        )
        sent = stub.requests[0]
        assert sent["n"] == 1 and sent["logprobs"] is True and sent["return_token_ids"] is True and sent["model"] == "m"
        stub.answers = [(400, {"error": {"message": "messages: is required"}})]
        with pytest.raises(
            RolloutServerError, match=r"/v1/chat/completions failed for conversation 0: HTTP 400: messages: is required"
        ):
            client.chat(TEXT_ONLY, params(loaded))
        assert len(stub.requests) == 3
    finally:
        stub.close()


def test_a_dead_server_fails_with_the_url_and_the_conversation(served):
    loaded, _ = served
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = OpenAIEngine(
        f"http://127.0.0.1:{port}", loaded.processor, ImageStore(), model="m", max_retries=2, backoff_s=0.01
    )
    with pytest.raises(
        RolloutServerError,
        match=rf"http://127.0.0.1:{port}/v1/chat/completions failed for game:3: gave up after 3 attempt\(s\); last: "
        r"cannot connect: .*refused",
    ):
        client.chat(TEXT_ONLY, params(loaded), names=["game:3"])


def test_a_server_that_disagrees_on_image_tokens_or_lacks_token_ids_is_an_error(served):
    loaded, _ = served
    store = ImageStore()
    red = store.add(Image.new("RGB", (64, 64), "red"))
    with_image = [[{"role": "user", "content": [image_part(red), text_part("colour?")]}]]
    stub = Stub([(200, answer([10, 11, 12], [40]))])  # no image tokens in the prompt
    try:
        client = OpenAIEngine(stub.url, loaded.processor, store, model="m")
        with pytest.raises(
            RolloutServerError,
            match=r"image 1 of 1: the server's prompt does not hold the 4 tokens the trainer's processor gives this "
            r"image.*disagree on the processor",
        ):
            client.chat(with_image, params(loaded), names=["colour:1"])
        assert stub.requests[0]["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
        stub.answers = [(200, {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]})]
        with pytest.raises(RolloutServerError, match="colour:1: the answer lacks 'prompt_token_ids'.*return_token_ids"):
            client.chat(with_image, params(loaded), names=["colour:1"])
    finally:
        stub.close()


def test_the_rollout_config_checks_the_openai_fields():
    base = {"model": {"init": "random", "family": "qwen3_vl"}}
    with pytest.raises(ConfigError, match=r"rollout\.url: is required with engine = \"openai\""):
        resolve_config(parse_config({**base, "rollout": {"engine": "openai"}}))
    with pytest.raises(
        ConfigError,
        match=r"rollout\.url: is for a server engine \(engine = \"openai\".*engine = 'embedded' runs in the trainer",
    ):
        resolve_config(parse_config({**base, "rollout": {"url": "http://127.0.0.1:8000"}}))
    with pytest.raises(ConfigError, match=r"rollout\.url: must start with http"):
        parse_config({**base, "rollout": {"engine": "openai", "url": "127.0.0.1:8000"}})
    with pytest.raises(ConfigError, match=r"rollout\.max_retries: must be >= 0"):
        parse_config({**base, "rollout": {"engine": "openai", "url": "http://h:1", "max_retries": -1}})
    synced = {"broadcast": {"transport": "filesystem"}}
    assert (
        resolve_config(
            parse_config({**base, **synced, "rollout": {"engine": "openai", "launch": True}})
        ).config.rollout.url
        is None
    )
    with pytest.raises(ConfigError, match=r"broadcast\.transport: must send the trained weights to the server"):
        resolve_config(parse_config({**base, "rollout": {"engine": "openai", "launch": True}}))
    rollout = parse_config(
        {
            **base,
            **synced,
            "rollout": {"engine": "openai", "url": "http://h:1/v1", "request_timeout_s": 5, "max_retries": 1},
        }
    ).rollout
    client = OpenAIEngine.from_config(rollout, processor=None, store=ImageStore())
    assert (client.url, client.timeout_s, client.max_retries, client.max_concurrent) == ("http://h:1", 5.0, 1, 64)


def test_a_base_url_with_or_without_v1_finds_the_servers_own_routes():
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert base_url(url) == "http://h:8000"
        assert f"{base_url(url)}/collective_rpc" == "http://h:8000/collective_rpc"  # not /v1/collective_rpc (a 404)


def test_requests_give_the_familys_vision_tokens_no_probability_as_the_trainer_does(served):
    """The trainer's distribution suppresses vision tokens; each request asks the server to do the same (logit_bias)."""
    loaded, _ = served
    stub = Stub([(200, answer([10, 11, 12], [40, 41]))])
    try:
        client = OpenAIEngine(stub.url + "/v1/", loaded.processor, ImageStore(), model="m")
        client.chat(TEXT_ONLY, params(loaded))
        vision = vision_token_ids(loaded.processor, loaded.resolved.descriptor)
        assert vision and stub.requests[0]["logit_bias"] == {str(i): -100 for i in vision}
    finally:
        stub.close()


def test_requests_to_vllm_carry_the_weight_version_s_cache_scope(served):
    """Under the trainer, vLLM's caches are scoped to the weights: a `cache_salt` per version (no prefix cached under
    older weights matches), and image uuids per version only when the syncs change the image side."""

    loaded, _ = served
    store = ImageStore()
    conversation = conversations(store)[0]  # an image and a question
    image_id = conversation[0]["content"][0]["image"]
    for images in (False, True):
        scope = CacheScope(images=images)
        stub = Stub([(200, {})])
        try:
            # one request per sample (share_prompts off): the group's requests share one salt, so one prefix
            client = OpenAIEngine(
                stub.url, loaded.processor, store, model="m", cache_scope=scope, max_retries=0, share_prompts=False
            )
            assert scope.applied  # the server now skips its cache resets
            stub.answers = [(200, answer(client.prompts.encode(conversation).input_ids, [40, 41]))]
            salts, uuids = [], []
            for _ in range(2):
                client.chat([conversation, conversation], params(loaded))
                sent = stub.requests[-2:]
                assert sent[0]["cache_salt"] == sent[1]["cache_salt"]  # one version: the group shares its prefix
                salts.append(sent[0]["cache_salt"])
                uuids.append(next(p for p in sent[0]["messages"][0]["content"] if p["type"] == "image_url")["uuid"])
                scope.advance()  # a sync
            assert salts[0] != salts[1] and all(len(s) > 30 for s in salts)
            if images:
                assert uuids[0] != uuids[1] and all(u.startswith(image_id) for u in uuids)
            else:
                assert uuids == [image_id, image_id]  # the content hash: an embedding stays good across versions
        finally:
            stub.close()
    plain = Stub([(200, answer([10, 11, 12], [40, 41]))])
    try:
        OpenAIEngine(plain.url, loaded.processor, ImageStore(), model="m").chat(TEXT_ONLY, params(loaded))
        assert "cache_salt" not in plain.requests[0]  # vlmreg serve, or a server attached without the trainer's scope
    finally:
        plain.close()
