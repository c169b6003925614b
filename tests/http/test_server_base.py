"""The hardened server base, the same on both servers built on it: `vlmreg serve` (a tiny model attached) and
`vlmreg env serve` (the colour_turns environment). Real servers on real sockets; the clients are raw sockets, so no
client library hides what went over the wire.

Each case runs against both: a client that drips its headers or its body a byte at a time (every byte inside the read
timeout) is cut at the request's deadline with no answer; a body over the limit is refused (413) before it is sent;
a request without the key is a 401 and changes nothing; stalled clients hold no thread, and past the open-connection
cap a client gets an immediate 503.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import vlmreg
from vlmreg.config import parse_config
from vlmreg.data import ImageStore
from vlmreg.envs import server as env_module
from vlmreg.envs.server import EnvServer
from vlmreg.envs.wire import example_to_json
from vlmreg.rewards import combine
from vlmreg.serve import server as serve_module
from vlmreg.serve.server import Server
from vlmreg.tasks import colour_turns

KEY = "base-test-key_0123456789abcdefghijkl"
READ_TIMEOUT_S = 1.0
CONFIG = {
    "model": {"init": "random", "family": "qwen3_vl"},
    "trainer": {"device": "cpu"},
    "rollout": {"max_concurrent_rollouts": 2},
}


class Served:
    """One of the two servers: ``post_path`` is a route that reads a body and changes state (``changed()`` says
    whether it did); ``body`` a request that route would act on."""

    def __init__(
        self, kind: str, server: Any, post_path: str, body: dict[str, Any], changed: Any, limit_module: Any
    ) -> None:
        self.kind, self.server, self.post_path, self.body, self.changed = kind, server, post_path, body, changed
        self.limit = limit_module.MAX_BODY_BYTES
        self.host, port = server.url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)

    def connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=10)


@pytest.fixture(scope="module", params=["vlmreg serve", "vlmreg env serve"])
def served(request) -> Iterator[Served]:
    if request.param == "vlmreg serve":
        torch.manual_seed(0)
        server = Server("127.0.0.1", 0, api_key=KEY, read_timeout_s=READ_TIMEOUT_S, max_connections=16, max_handlers=4)
        server.attach(vlmreg.load(parse_config(CONFIG)))
        server.start()
        body = {"step": 1, "path": "/nonexistent/step_000001"}
        yield Served(request.param, server, "/v1/weights", body, lambda: server.weights.step is not None, serve_module)
    else:
        spec = vlmreg.get_environment_registry().get("colour_turns")
        server = EnvServer(
            spec, combine(spec.reward), api_key=KEY, read_timeout_s=READ_TIMEOUT_S, max_connections=16
        ).start()
        store = ImageStore()
        [example] = colour_turns.generate(1, 0, store)
        sent, images = example_to_json(example, store)
        body = {"episode": "base-test", "example": sent, "images": images}
        yield Served(request.param, server, "/reset", body, lambda: server.live_sessions > 0, env_module)
    server.close()


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP answer: status, headers (lower-case names) and the body (by Content-Length, else to the close)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the server closed the connection without an answer (got {data[:200]!r})")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
    length = int(headers.get("content-length", -1))
    while length < 0 or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def post(
    served: Served, path: str, body: dict[str, Any], key: str | None
) -> tuple[int, dict[str, str], dict[str, Any]]:
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    with served.connect() as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: "
            f"{len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        status, headers, raw = read_answer(sock)
    return status, headers, json.loads(raw)


def health_is_answered(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_answer(sock)[0] == 200


def drip(sock: socket.socket, head: bytes, every_s: float, give_up_s: float = 8.0) -> tuple[float, bytes | None]:
    """Send ``head``, then a byte every ``every_s`` (inside the read timeout) until the server hangs up; how long that
    took and what it sent (``None``: still open after ``give_up_s``, the server never cut it)."""
    sock.sendall(head)
    started = time.monotonic()
    stop = threading.Event()

    def one_byte_at_a_time() -> None:
        try:
            while not stop.wait(every_s):
                sock.sendall(b"a")
        except OSError:
            pass

    dripper = threading.Thread(target=one_byte_at_a_time, daemon=True)
    dripper.start()
    try:
        sock.settimeout(give_up_s)
        try:
            answer: bytes | None = sock.recv(1024)
        except ConnectionResetError:
            answer = b""
        except TimeoutError:
            answer = None
        return time.monotonic() - started, answer
    finally:
        stop.set()
        dripper.join(5)
        sock.close()


# -- slow clients ------------------------------------------------------------------------------------------------------
def test_a_client_that_drips_its_headers_is_cut_at_the_header_deadline(served):
    head = f"POST {served.post_path} HTTP/1.1\r\nHost: x\r\nX-Slow: ".encode()
    elapsed, answer = drip(served.connect(), head, READ_TIMEOUT_S / 4)
    assert answer == b"", f"{served.kind} kept a client dripping its headers for {elapsed:.1f} s (answer {answer!r})"
    assert READ_TIMEOUT_S * 0.8 < elapsed < READ_TIMEOUT_S + 2, elapsed
    health_is_answered(served)


def test_a_client_that_drips_its_body_is_cut_at_the_body_deadline(served):
    """The whole request has a deadline: the read timeout plus the body's length at 256 KiB/s (1000 bytes: ~1 s)."""
    head = (
        f"POST {served.post_path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n{{"
    ).encode()
    elapsed, answer = drip(served.connect(), head, READ_TIMEOUT_S / 4)
    assert answer == b"", f"{served.kind} kept a client dripping its body for {elapsed:.1f} s (answer {answer!r})"
    assert READ_TIMEOUT_S * 0.8 < elapsed < READ_TIMEOUT_S + 2, elapsed
    assert not served.changed()
    health_is_answered(served)


# -- bodies
# --------------------------------------------------------------------------------------------------------------
def test_a_body_over_the_limit_is_a_413_before_it_is_sent(served):
    """The headers claim one byte over the limit; 64 KiB of it are sent, and the 413 comes without waiting for more."""
    claimed = served.limit + 1
    with served.connect() as sock:
        sock.sendall(
            f"POST {served.post_path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {claimed}\r\n\r\n".encode()
            + b"{"
            + b" " * 65535
        )
        started = time.monotonic()
        status, headers, body = read_answer(sock)
        assert time.monotonic() - started < READ_TIMEOUT_S
    assert (
        status == 413
        and f"the body is {claimed} bytes, more than {served.limit}" in json.loads(body)["error"]["message"]
    )
    assert headers.get("connection") == "close" and not served.changed()


# -- auth
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", [None, "not-the-key"], ids=["no key", "a wrong key"])
def test_a_request_without_the_key_is_a_401_and_changes_nothing(served, key):
    status, headers, body = post(served, served.post_path, served.body, key)
    assert status == 401 and headers["www-authenticate"].startswith("Bearer"), (status, body)
    assert "Authorization: Bearer KEY" in body["error"]["message"] and KEY not in json.dumps(body)
    assert not served.changed()


def test_the_same_request_with_the_key_reaches_the_route(served):
    """What the 401 above held back: with the key, the route runs (env serve opens the episode; vlmreg serve, which
    has no --weights-dir here, refuses the path itself)."""
    status, _, body = post(served, served.post_path, served.body, KEY)
    if served.kind == "vlmreg serve":
        assert status == 403 and body["error"]["code"] == "path_not_allowed"
    else:
        assert status == 200 and served.changed()
        assert post(served, "/close", {"episode": served.body["episode"]}, KEY)[2]["closed"] is True


# -- caps
# ------------------------------------------------------------------------------------------------------------------
def test_stalled_clients_hold_no_thread_and_past_the_connection_cap_get_a_503(served):
    """16 open connections at most: 15 clients stall mid-body (received by one housekeeping thread, not a thread
    each) while a normal request is answered; the 17th connection gets an immediate 503 with ``Retry-After``."""
    baseline = threading.active_count()
    head = (
        f"POST {served.post_path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n{{"
    ).encode()
    stalled = []
    try:
        for _ in range(15):
            sock = served.connect()
            sock.sendall(head)
            stalled.append(sock)
        time.sleep(0.3)
        assert threading.active_count() <= baseline + 2, (
            f"{served.kind}: {threading.active_count() - baseline} more threads"
        )
        health_is_answered(served)  # the 16th connection
        deadline = time.monotonic() + 5
        while served.server.admission.handlers and time.monotonic() < deadline:  # its handler lets its connection go
            time.sleep(0.01)
        stalled.append(served.connect())
        with served.connect() as refused:
            status, headers, body = read_answer(refused)
        assert (
            status == 503
            and headers["retry-after"] == "1"
            and "16 connections are open" in json.loads(body)["error"]["message"]
        )
    finally:
        for sock in stalled:
            sock.close()
