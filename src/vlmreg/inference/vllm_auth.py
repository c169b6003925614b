"""An API key for all of vLLM's endpoints, weight updates included (``--middleware`` of vLLM's API server).

vLLM's own ``--api-key`` guards only paths under ``/v1``, ``/v2`` and ``/inference``: with ``VLLM_SERVER_DEV_MODE=1``,
``/update_weights``, ``/collective_rpc`` and ``/reset_prefix_cache`` stay open to anyone who reaches the port. Started
with ``--middleware vlmreg.inference.vllm_auth.RequireApiKey`` and ``VLMREG_API_KEY`` in its environment, vLLM
answers every request except ``GET /health`` with 401 unless it carries ``Authorization: Bearer KEY``. Without
``VLMREG_API_KEY`` the middleware lets everything through (and says so once on stderr).

A plain ASGI class, so it needs nothing beyond the standard library; vLLM adds it with ``app.add_middleware``.
"""

from __future__ import annotations

import hmac
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["API_KEY_ENV", "OPEN_PATHS", "RequireApiKey"]

API_KEY_ENV = "VLMREG_API_KEY"
OPEN_PATHS = frozenset({"/health"})

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class RequireApiKey:
    """ASGI middleware: every HTTP request but ``GET /health`` needs ``Authorization: Bearer $VLMREG_API_KEY``."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], key: str | None = None) -> None:
        self.app = app
        key = key if key is not None else os.environ.get(API_KEY_ENV)
        self.key = key.encode() if key else None
        if self.key is None:
            print(f"vlmreg: {API_KEY_ENV} is not set; every endpoint of this server is open", file=sys.stderr)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope.get("type") not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if (scope.get("method") == "GET" and path in OPEN_PATHS) or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        token = _bearer(scope)
        if token is not None and hmac.compare_digest(token, self.key):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(
            {
                "error": {
                    "message": "a valid API key is required (Authorization: Bearer KEY)",
                    "type": "invalid_request_error",
                    "code": "invalid_api_key",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Bearer realm="vlmreg"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
