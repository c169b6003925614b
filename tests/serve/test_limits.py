"""`vlmreg serve` against clients that send too much or too slowly: the body limit (413 before the body is read),
the header limits (431 / 414), the socket read timeout (a stalled client is dropped while others are served), the
idle timeout, and the caps on open connections and handler threads (stalled clients past them hold no thread).

A real server on a real socket; the clients are raw sockets, so nothing in a client library hides what went over
the wire.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch

import vlmreg
from vlmreg.config import parse_config
from vlmreg.http import connections
from vlmreg.serve import Server, serve_in_thread
from vlmreg.serve import server as server_module

CONFIG = {
    "model": {"init": "random", "family": "qwen3_vl"},
    "trainer": {"device": "cpu"},
    "rollout": {"max_concurrent_rollouts": 2},
}
READ_TIMEOUT_S = 1.0
CHAT = json.dumps(
    {"model": "qwen3_vl-tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
).encode()


@pytest.fixture(scope="module")
def loaded():
    torch.manual_seed(0)
    return vlmreg.load(parse_config(CONFIG))


@pytest.fixture(scope="module")
def served(loaded) -> Iterator[tuple[object, str, int]]:
    server, url = serve_in_thread(loaded)
    server.read_timeout_s = READ_TIMEOUT_S
    host, port = url.removeprefix("http://").split(":")
    yield server, host, int(port)
    server.close()


def connect(served) -> socket.socket:
    _, host, port = served
    return socket.create_connection((host, port), timeout=10)


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP answer: status, headers (lower-case names) and the body (by Content-Length, else to the close)."""
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


def chat_works(served) -> None:
    """A normal client is answered: the server went on."""
    with connect(served) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(CHAT) + CHAT
        )
        status, _, body = read_answer(sock)
    assert status == 200 and json.loads(body)["choices"], body[:300]


def health_works(served) -> float:
    _, host, port = served
    started = time.monotonic()
    with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=10) as response:
        assert response.status == 200
    return time.monotonic() - started


def test_a_body_over_the_limit_is_a_413_before_any_of_it_is_read(served):
    """The headers claim 300 MB; only 64 KiB are sent, and the 413 arrives without waiting for the rest."""
    claimed = server_module.MAX_BODY_BYTES + 1
    for path in ("/v1/chat/completions", "/v1/weights"):
        with connect(served) as sock:
            sock.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                f"{claimed}\r\n\r\n".encode()
            )
            sock.sendall(b"{" + b" " * 65535)
            started = time.monotonic()
            status, headers, body = read_answer(sock)
            assert time.monotonic() - started < READ_TIMEOUT_S, (
                "the 413 must not wait for the body (or the read timeout)"
            )
        error = json.loads(body)["error"]
        if path == "/v1/weights":  # weights are off on this server: refused before the body is looked at
            assert status == 403 and error["code"] == "weights_disabled"
            continue
        assert (
            status == 413
            and error["message"] == f"the body is {claimed} bytes, more than {server_module.MAX_BODY_BYTES}"
        )
        assert headers.get("connection") == "close"
    chat_works(served)


def test_a_body_just_over_a_lowered_limit_is_refused_and_one_at_it_is_read(served, monkeypatch):
    monkeypatch.setattr(served[0], "max_body_bytes", len(CHAT))
    chat_works(served)  # exactly at the limit: read
    padded = CHAT[:-1] + b" }"
    with connect(served) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(padded) + padded
        )
        status, _, body = read_answer(sock)
    assert status == 413 and f"the body is {len(padded)} bytes, more than {len(CHAT)}" in body.decode()


@pytest.mark.parametrize("length", ["-5", "12abc", "1e9", ""])
def test_a_content_length_that_is_not_a_number_is_a_411(served, length):
    with connect(served) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode())
        status, _, body = read_answer(sock)
    assert status == 411 and "Content-Length header is required" in body.decode()


def test_a_chunked_body_is_refused_not_read(served):
    with connect(served) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1000000\r\n")
        status, _, body = read_answer(sock)
    assert status == 411 and "chunked request bodies are not supported" in body.decode()


@pytest.mark.parametrize(
    "request_head, status",
    [
        (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(101)) + b"\r\n", 431),  # too many
        (b"GET /health HTTP/1.1\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n", 431),  # one header line too long
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),  # the request line too long
    ],
    ids=["101 headers", "a 70 kB header", "a 70 kB request line"],
)
def test_too_many_or_too_long_headers_are_refused(served, request_head, status):
    with connect(served) as sock:
        sock.sendall(request_head)
        answer, _, _ = read_answer(sock)
        assert answer == status
        sock.settimeout(5)
        assert sock.recv(65536) == b""  # and the connection is closed
    assert health_works(served) < 5


def test_a_client_that_stalls_mid_body_is_dropped_after_the_read_timeout_while_others_are_served(served):
    stalled = connect(served)
    stalled.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"model": ')
    started = time.monotonic()
    chat_works(served)  # served while the other one stalls
    assert health_works(served) < READ_TIMEOUT_S
    stalled.settimeout(10)
    assert stalled.recv(1024) == b""  # dropped, no answer owed
    elapsed = time.monotonic() - started
    stalled.close()
    assert READ_TIMEOUT_S * 0.8 < elapsed < READ_TIMEOUT_S + 3, elapsed
    chat_works(served)


def test_clients_that_stall_in_their_headers_are_dropped_and_do_not_starve_others(served):
    stalled = [connect(served) for _ in range(20)]
    for sock in stalled:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")  # never finished
    started = time.monotonic()
    chat_works(served)
    for sock in stalled:
        sock.settimeout(10)
        assert sock.recv(1024) == b""
        sock.close()
    assert time.monotonic() - started < READ_TIMEOUT_S + 3
    chat_works(served)


def _drip(sock: socket.socket, head: bytes, every_s: float) -> tuple[float, bytes]:
    """Send ``head``, then a byte every ``every_s`` (inside the read timeout) until the server hangs up."""
    sock.sendall(head)
    started = time.monotonic()
    stop = threading.Event()

    def drip() -> None:
        try:
            while not stop.wait(every_s):
                sock.sendall(b"a")
        except OSError:
            pass

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        sock.settimeout(60)
        try:
            answer = sock.recv(1024)
        except ConnectionResetError:
            answer = b""
        return time.monotonic() - started, answer
    finally:
        stop.set()
        dripper.join(5)
        sock.close()


def test_a_client_that_drips_its_body_is_dropped_at_the_body_deadline(served):
    """One byte every half read timeout: every read succeeds, but the body as a whole has a deadline."""
    server = served[0]
    deadline = server.request_deadline_s(1000)
    assert deadline < READ_TIMEOUT_S + 0.1  # 1000 bytes at the minimum rate take no time
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    elapsed, answer = _drip(connect(served), head, READ_TIMEOUT_S / 4)
    assert answer == b"" and deadline * 0.8 < elapsed < deadline + 2, elapsed  # dropped, nothing answered
    chat_works(served)


def test_a_client_that_drips_its_headers_is_dropped_at_the_header_deadline(served):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "
    elapsed, answer = _drip(connect(served), head, READ_TIMEOUT_S / 4)
    assert answer == b"" and READ_TIMEOUT_S * 0.8 < elapsed < READ_TIMEOUT_S + 2, elapsed
    chat_works(served)


def test_a_slow_but_steady_body_within_its_deadline_is_read(served):
    """A body sent in pieces, each inside the read timeout and all inside the deadline, is answered normally."""
    with connect(served) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % len(CHAT)
        )
        for piece in (CHAT[:10], CHAT[10:40], CHAT[40:]):
            time.sleep(READ_TIMEOUT_S / 5)
            sock.sendall(piece)
        status, _, body = read_answer(sock)
    assert status == 200 and json.loads(body)["choices"]


# -- idle clients and the caps on connections and threads -----------------------------------------------------
@pytest.fixture
def capped(loaded) -> Iterator[tuple[Server, str, int]]:
    """A server with small caps: 6 handler threads, 32 open connections, a 1.5 s read timeout, a 0.5 s idle timeout."""
    server = Server("127.0.0.1", 0, max_handlers=6, max_connections=32, read_timeout_s=1.5, idle_timeout_s=0.5)
    server.attach(loaded)
    server.start()
    yield server, "127.0.0.1", int(server.url.rsplit(":", 1)[1])
    server.close()


def _closed_or_answered(sock: socket.socket, within_s: float) -> bytes:
    """What the server sends before it closes ``sock`` (``b""``: nothing), waiting at most ``within_s``."""
    sock.settimeout(within_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _handler_threads() -> int:
    return sum(t.name == "vlmreg-serve-handler" for t in threading.enumerate())


def test_an_idle_connection_is_closed_after_the_idle_timeout_and_a_prompt_one_is_served(capped):
    """A client that connects and sends nothing is closed after ``idle_timeout_s`` (0.5 s), long before the read
    timeout (1.5 s); one that starts its request inside the idle timeout is answered."""
    server = capped[0]
    with connect(capped) as idle:
        started = time.monotonic()
        assert _closed_or_answered(idle, 10) == b""
        elapsed = time.monotonic() - started
    assert server.idle_timeout_s * 0.8 < elapsed < server.read_timeout_s, elapsed
    with connect(capped) as prompt:
        time.sleep(server.idle_timeout_s / 3)
        prompt.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(CHAT) + CHAT
        )
        status, _, body = read_answer(prompt)
    assert status == 200 and json.loads(body)["choices"]


def test_stalled_clients_hold_no_thread_and_past_the_connection_cap_are_refused(capped):
    """30 clients stall mid-body (each used to hold a thread): none holds a handler thread, they are received by the
    one housekeeping thread, and a normal client is answered meanwhile. Of 5 more, 2 fit the 32 open connections
    and 3 get an immediate 503. Every stalled client is dropped, with no answer, at its body deadline."""
    server, host, port = capped
    baseline = threading.active_count()
    head = b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"model": '
    stalled = []
    for _ in range(30):
        sock = socket.create_connection((host, port), timeout=10)
        sock.sendall(head)
        stalled.append(sock)
    deadline = time.monotonic() + 5
    while server.admission.receiving < 30 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.admission.receiving == 30 and server.admission.handlers == 0 and _handler_threads() == 0
    assert threading.active_count() <= baseline + 2  # the housekeeping thread, and the deadlines' at most
    chat_works(capped)  # the 31st connection: answered at once
    deadline = time.monotonic() + 5
    while server.admission.handlers and time.monotonic() < deadline:  # its handler lets its connection go
        time.sleep(0.01)
    more = []
    for _ in range(5):
        sock = socket.create_connection((host, port), timeout=10)
        sock.sendall(head)
        more.append(sock)
    refused = [read_answer(sock) for sock in more[2:]]
    assert all(
        status == 503 and headers["retry-after"] == "1" and b"32 connections are open" in body
        for status, headers, body in refused
    )
    started = time.monotonic()
    outcomes = [_closed_or_answered(sock, 10) for sock in stalled + more[:2]]
    elapsed = time.monotonic() - started
    for sock in stalled + more:
        sock.close()
    assert outcomes == [b""] * 32  # dropped at the body deadline, nothing answered
    assert elapsed < server.request_deadline_s(1000) + 2, elapsed
    assert server.admission.receiving == 0 and server.admission.handlers == 0
    chat_works(capped)


def test_a_burst_past_the_handler_cap_waits_in_line_and_is_answered(capped):
    """20 prompt clients at once, 6 handler threads: the others wait in line without a thread and are all answered,
    while at most 6 handler threads run."""
    results: list[int] = []

    def one() -> None:
        with connect(capped) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(CHAT) + CHAT
            )
            results.append(read_answer(sock)[0])

    clients = [threading.Thread(target=one) for _ in range(20)]
    for client in clients:
        client.start()
    most = 0
    while any(client.is_alive() for client in clients):
        most = max(most, _handler_threads())
        time.sleep(0.005)
    assert results == [200] * 20 and 1 <= most <= 6


@pytest.mark.parametrize("limit", ["PREFETCH_LIMIT", "PREFETCH_BUDGET"])
def test_a_request_too_large_to_read_ahead_is_read_on_by_its_handler(served, monkeypatch, limit):
    """A body over the read-ahead limit, or bytes past the budget for all arrivals, go to a handler with what has
    arrived so far; it reads the rest (sent in pieces here) and answers as usual."""
    monkeypatch.setattr(connections, limit, 40)
    with connect(served) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(CHAT) + CHAT[:10]
        )
        time.sleep(0.2)
        sock.sendall(CHAT[10:])
        status, _, body = read_answer(sock)
    assert status == 200 and json.loads(body)["choices"]
