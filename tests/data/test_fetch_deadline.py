"""http_timeout_s is a wall-clock deadline for a whole image fetch, against servers that drip bytes slowly.

urllib's ``timeout`` bounds each socket wait, so a server that sends one byte every 0.1 s never trips it; these
servers do exactly that, for the headers and for the body, and the fetch must still fail within the deadline.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tests.data.samples import png_bytes
from vlmreg.data.images import ImageError, ImageLimits, decode_image

WHERE = "data/train.jsonl:3 image"
DEADLINE_S = 1.5
DRIP_S = 0.1  # far below the deadline: every single socket wait succeeds
PNG = png_bytes((5, 4), (9, 8, 7))


def _send_slowly(conn: socket.socket, data: bytes, stop: threading.Event) -> None:
    for i in range(len(data)):
        if stop.wait(DRIP_S):
            return
        conn.sendall(data[i:i + 1])


def _read_request(conn: socket.socket) -> str:
    request = b""
    while b"\r\n\r\n" not in request:
        chunk = conn.recv(4096)
        if not chunk:
            break
        request += chunk
    return request.split(b" ", 2)[1].decode() if request.count(b" ") >= 2 else "/"


class _RawServer:
    """A threading TCP server: each connection's request path goes to ``respond(conn, path, stop)``."""

    def __init__(self, respond: Callable[[socket.socket, str, threading.Event], None]) -> None:
        self.respond, self.stop = respond, threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                self.respond(conn, _read_request(conn), self.stop)
            except OSError:  # the client hung up: that is what the deadline is for
                pass

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(timeout=5)


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket, str, threading.Event], None]], _RawServer]]:
    servers: list[_RawServer] = []

    def start(respond: Callable[[socket.socket, str, threading.Event], None]) -> _RawServer:
        servers.append(_RawServer(respond))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _fails_within_deadline(url: str, limits: ImageLimits) -> str:
    started = time.monotonic()
    with pytest.raises(ImageError) as info:
        decode_image(url, limits=limits, where=WHERE)
    elapsed = time.monotonic() - started
    assert elapsed < limits.http_timeout_s + 1.0, f"the fetch took {elapsed:.1f} s with http_timeout_s = {limits.http_timeout_s}"
    return str(info.value)


LIMITS = ImageLimits(allow_http=True, http_timeout_s=DEADLINE_S)


def test_headers_dripped_a_byte_at_a_time_hit_the_deadline(serve):
    def drip_headers(conn: socket.socket, path: str, stop: threading.Event) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nX-Padding: " + b"a" * 200 + b"\r\n\r\n"
        _send_slowly(conn, head, stop)  # 250 bytes at 0.1 s each: 25 s if nothing stops it

    server = serve(drip_headers)
    url = server.url("/slow-headers.png")
    message = _fails_within_deadline(url, LIMITS)
    assert message == f"{WHERE}: timed out after {DEADLINE_S:g} s fetching {url}"


def test_a_body_dripped_a_byte_at_a_time_hits_the_deadline(serve):
    def drip_body(conn: socket.socket, path: str, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: %d\r\n\r\n" % len(PNG))
        _send_slowly(conn, PNG, stop)

    server = serve(drip_body)
    url = server.url("/slow-body.png")
    assert len(PNG) * DRIP_S > DEADLINE_S + 2  # the drip really outlasts the deadline
    message = _fails_within_deadline(url, LIMITS)
    assert message == f"{WHERE}: timed out after {DEADLINE_S:g} s fetching {url}"


def test_a_server_that_accepts_and_never_answers_hits_the_deadline(serve):
    server = serve(lambda conn, path, stop: stop.wait(30))
    url = server.url("/silent.png")
    limits = ImageLimits(allow_http=True, http_timeout_s=0.5)
    assert _fails_within_deadline(url, limits) == f"{WHERE}: timed out after 0.5 s fetching {url}"


def test_a_fast_server_is_fetched_and_an_infinite_timeout_does_not_crash(serve):
    def answer(conn: socket.socket, path: str, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: %d\r\n\r\n" % len(PNG) + PNG)

    server = serve(answer)
    for timeout in (DEADLINE_S, float("inf")):
        image = decode_image(server.url("/ok.png"), limits=ImageLimits(allow_http=True, http_timeout_s=timeout), where=WHERE)
        assert image.size == (5, 4) and image.getpixel((0, 0)) == (9, 8, 7)


def _redirects(hops: int, last: str | None = None) -> Callable[[socket.socket, str, threading.Event], None]:
    """``/r/<n>`` redirects to ``/r/<n-1>``; ``/r/0`` is the image, or a redirect to ``last`` when given."""

    def respond(conn: socket.socket, path: str, stop: threading.Event) -> None:
        n = int(path.rsplit("/", 1)[1].split(".")[0])
        if n > 0 or last is not None:
            target = f"/r/{n - 1}.png" if n > 0 else last
            conn.sendall(f"HTTP/1.1 302 Found\r\nLocation: {target}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: %d\r\n\r\n" % len(PNG) + PNG)

    return respond


def test_at_most_five_redirects_are_followed(serve):
    server = serve(_redirects(hops=6))
    image = decode_image(server.url("/r/5.png"), limits=LIMITS, where=WHERE)  # five hops: fine
    assert image.size == (5, 4)
    connections = server.connections
    url = server.url("/r/6.png")
    with pytest.raises(ImageError) as info:
        decode_image(url, limits=LIMITS, where=WHERE)
    assert str(info.value) == f"{WHERE}: cannot fetch {url}: more than 5 redirects (the last to {server.url('/r/0.png')})"
    assert server.connections - connections == 6  # the sixth redirect was never followed


@pytest.mark.parametrize("target", ["ftp://example.com/a.png", "gopher://example.com/a.png"])
def test_a_redirect_to_another_scheme_is_refused(serve, target):
    server = serve(_redirects(hops=1, last=target))
    url = server.url("/r/1.png")
    with pytest.raises(ImageError) as info:
        decode_image(url, limits=LIMITS, where=WHERE)
    message = str(info.value)
    if target.startswith("ftp:"):  # ftp is a scheme urllib itself would follow: our handler refuses it
        assert message == f"{WHERE}: cannot fetch {url}: redirect to {target} refused (only http(s) is fetched)"
    else:  # urllib refuses other schemes before our handler sees them
        assert message.startswith(f"{WHERE}: HTTP 302 Found") and f"'{target}' is not allowed" in message
