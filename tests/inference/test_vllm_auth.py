"""The API-key middleware vLLM loads with --middleware, driven as an ASGI server drives it."""

from __future__ import annotations

import asyncio
import json

import pytest

from vlmreg.inference import vllm_auth
from vlmreg.inference.vllm_auth import RequireApiKey

KEY = "k3y-Secret_value"


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"inner"})


def call(middleware, method: str, path: str, authorization: str | None = None, kind: str = "http"):
    headers = [(b"host", b"x")] + ([(b"authorization", authorization.encode())] if authorization is not None else [])
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(middleware({"type": kind, "method": method, "path": path, "headers": headers}, receive, send))
    return sent


@pytest.mark.parametrize(
    "path", ["/update_weights", "/collective_rpc", "/reset_prefix_cache", "/v1/chat/completions", "/v1/models", "/nope"]
)
@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x"])
def test_every_endpoint_but_health_needs_the_key(path, authorization):
    sent = call(RequireApiKey(_app, key=KEY), "POST", path, authorization)
    assert sent[0]["status"] == 401
    assert (b"www-authenticate", b'Bearer realm="vlmreg"') in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("authorization", [f"Bearer {KEY}", f"bearer {KEY}"])
def test_the_key_lets_a_request_through(authorization):
    sent = call(RequireApiKey(_app, key=KEY), "POST", "/update_weights", authorization)
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"inner"


def test_health_stays_open_and_no_key_means_open(monkeypatch, capsys):
    assert call(RequireApiKey(_app, key=KEY), "GET", "/health")[0]["status"] == 200
    assert call(RequireApiKey(_app, key=KEY), "POST", "/health")[0]["status"] == 401  # only reading health is open
    monkeypatch.delenv("VLMREG_API_KEY", raising=False)
    assert call(RequireApiKey(_app), "POST", "/update_weights")[0]["status"] == 200
    assert "VLMREG_API_KEY is not set" in capsys.readouterr().err
    monkeypatch.setenv("VLMREG_API_KEY", KEY)
    assert call(RequireApiKey(_app), "POST", "/update_weights")[0]["status"] == 401
    assert call(RequireApiKey(_app), "POST", "/update_weights", f"Bearer {KEY}")[0]["status"] == 200


def test_a_websocket_without_the_key_is_closed():
    assert call(RequireApiKey(_app, key=KEY), "GET", "/v1/realtime", kind="websocket") == [
        {"type": "websocket.close", "code": 1008}
    ]


def test_the_trainer_gives_a_launched_vllm_its_key_in_the_variable_the_middleware_reads():
    """`ServerLink` sets one variable for whichever server it launches or attaches, `vlmreg serve` or vLLM; this
    middleware must read that one."""
    from vlmreg.inference import server_link  # noqa: PLC0415 - it loads torch, which the other tests here do without

    assert server_link.API_KEY_ENV == vllm_auth.API_KEY_ENV == "VLMREG_API_KEY"
