"""http_timeout_s is a wall-clock deadline for a whole image fetch, against servers that drip bytes slowly.

urllib's ``timeout`` bounds each socket wait, so a server that sends one byte every 0.1 s never trips it; these
servers do exactly that, for the headers and for the body, and the fetch must still fail within the deadline.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator

import pytest

from tests.data.samples import png_bytes
from vlmreg.config.checks import SectionInvalid
from vlmreg.config.schema import DataSection
from vlmreg.data.images import ImageError, ImageLimits, decode_image

WHERE = "data/train.jsonl:3 image"
DEADLINE_S = 1.5
DRIP_S = 0.1  # far below the deadline: every single socket wait succeeds
PNG = png_bytes((5, 4), (9, 8, 7))


def _send_slowly(conn: socket.socket, data: bytes, stop: threading.Event) -> None:
    for i in range(len(data)):
        if stop.wait(DRIP_S):
            return
        conn.sendall(data[i : i + 1])


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
    assert elapsed < limits.http_timeout_s + 1.0, (
        f"the fetch took {elapsed:.1f} s with http_timeout_s = {limits.http_timeout_s}"
    )
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
        image = decode_image(
            server.url("/ok.png"), limits=ImageLimits(allow_http=True, http_timeout_s=timeout), where=WHERE
        )
        assert image.size == (5, 4) and image.getpixel((0, 0)) == (9, 8, 7)


def _redirects(hops: int, last: str | None = None) -> Callable[[socket.socket, str, threading.Event], None]:
    """``/r/<n>`` redirects to ``/r/<n-1>``; ``/r/0`` is the image, or a redirect to ``last`` when given."""

    def respond(conn: socket.socket, path: str, stop: threading.Event) -> None:
        n = int(path.rsplit("/", 1)[1].split(".")[0])
        if n > 0 or last is not None:
            target = f"/r/{n - 1}.png" if n > 0 else last
            conn.sendall(
                f"HTTP/1.1 302 Found\r\nLocation: {target}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()
            )
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
    assert (
        str(info.value) == f"{WHERE}: cannot fetch {url}: more than 5 redirects (the last to {server.url('/r/0.png')})"
    )
    assert server.connections - connections == 6  # the sixth redirect was never followed


@pytest.mark.parametrize(
    "target", ["ftp://example.com/a.png", "gopher://example.com/a.png", "data:image/png;base64,AAAA"]
)
def test_a_redirect_to_another_scheme_is_refused(serve, target):
    server = serve(_redirects(hops=1, last=target))
    url = server.url("/r/1.png")
    with pytest.raises(ImageError) as info:
        decode_image(url, limits=LIMITS, where=WHERE)
    # checked before urllib's own check (which would follow ftp://): the same message for every scheme
    assert str(info.value) == f"{WHERE}: cannot fetch {url}: redirect to {target} refused (only http(s) is fetched)"


# -- redirects are checked against the first URL's rules: a real http.server in a thread ------------------------
class _Handler(http.server.BaseHTTPRequestHandler):
    """``/image.png`` is the image; ``/to?u=URL`` redirects there (302); every request path is recorded."""

    def do_GET(self) -> None:
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        if self.path.startswith("/to?u="):
            self.send_response(302)
            self.send_header("Location", urllib.parse.unquote(self.path[len("/to?u=") :]))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[Callable[[str], http.server.ThreadingHTTPServer]]:
    """Start ``http.server`` servers on ``host`` (a free port each) in threads; every one is closed afterwards."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(host: str = "127.0.0.1") -> http.server.ThreadingHTTPServer:
        server = http.server.ThreadingHTTPServer((host, 0), _Handler)
        server.paths = []  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _url(server: http.server.ThreadingHTTPServer, path: str, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{server.server_address[1]}{path}"


def _redirect(server: http.server.ThreadingHTTPServer, target: str) -> str:
    return _url(server, "/to?u=" + urllib.parse.quote(target, safe=""))


def _refused(url: str, limits: ImageLimits = LIMITS) -> str:
    with pytest.raises(ImageError) as info:
        decode_image(url, limits=limits, where=WHERE)
    return str(info.value)


def test_a_redirect_on_the_same_host_and_port_is_followed(http_server):
    server = http_server()
    image = decode_image(_redirect(server, "/image.png"), limits=LIMITS, where=WHERE)  # a relative Location
    assert image.size == (5, 4) and server.paths[-1] == "/image.png"
    image = decode_image(_redirect(server, _url(server, "/image.png")), limits=LIMITS, where=WHERE)  # an absolute one
    assert image.size == (5, 4) and server.paths[-1] == "/image.png"


def test_a_redirect_to_another_port_or_host_is_refused_and_never_fetched(http_server):
    first, other = http_server(), http_server()
    for target in (_url(other, "/image.png"), _url(other, "/image.png", host="localhost")):
        url = _redirect(first, target)
        message = _refused(url)
        assert message == (
            f"{WHERE}: cannot fetch {url}: redirect to {target} refused: it leaves 127.0.0.1:{first.server_address[1]} "
            "for another host (to allow it, add that host to [data] http_redirect_hosts)"
        )
    assert other.paths == []  # the other server was never asked for anything
    # another name for the same machine: refused too
    url = _redirect(first, _url(first, "/image.png", host="localhost"))
    assert "refused: it leaves" in _refused(url) and first.paths.count("/image.png") == 0


def test_a_redirect_to_a_host_in_http_redirect_hosts_is_followed(http_server, tmp_path):
    first, other = http_server(), http_server()
    target = _url(other, "/image.png")
    for allowed in ([f"127.0.0.1:{other.server_address[1]}"], ["127.0.0.1"]):  # host:port, or the host at any port
        section = DataSection(
            paths=["a.jsonl"], allow_http=True, http_timeout_s=DEADLINE_S, http_redirect_hosts=allowed
        )
        limits = ImageLimits.from_section(section, base_dir=tmp_path)
        assert limits.redirect_hosts == tuple(allowed)
        assert decode_image(_redirect(first, target), limits=limits, where=WHERE).size == (5, 4)
    assert other.paths == ["/image.png", "/image.png"]
    limits = ImageLimits(
        allow_http=True, http_timeout_s=DEADLINE_S, redirect_hosts=(f"127.0.0.1:{first.server_address[1]}",)
    )
    assert "refused: it leaves" in _refused(_redirect(first, target), limits)  # the wrong port is still another host
    assert "refused: it leaves" in _refused(_redirect(first, _url(other, "/image.png", host="localhost")), limits)


def test_a_redirect_to_a_file_url_is_refused_and_the_file_is_not_read(http_server, tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(PNG)
    server = http_server()
    for target in (secret.as_uri(), "file:///etc/passwd"):
        url = _redirect(server, target)
        assert _refused(url) == f"{WHERE}: cannot fetch {url}: redirect to {target} refused (only http(s) is fetched)"
    # with path confinement on (as the dataset loader runs it) and the file inside the allowed folder: still refused
    confined = ImageLimits(allow_http=True, http_timeout_s=DEADLINE_S, base_dir=tmp_path, roots=(tmp_path,))
    assert decode_image(secret.as_uri(), limits=confined, where=WHERE).size == (5, 4)  # as a dataset path it is fine
    assert "only http(s) is fetched" in _refused(_redirect(server, secret.as_uri()), confined)


@pytest.mark.parametrize(
    "entry, problem",
    [
        ("http://cdn.example.com", "must be a host name or host:port"),
        ("cdn.example.com/x", "must be a host name or host:port"),
        ("cdn.example.com:99999", "has a port that is not a number"),
        ("", "must be a host name or host:port"),
        ("user@cdn.example.com", "must be a host name or host:port"),
    ],
)
def test_a_bad_http_redirect_hosts_entry_is_refused_naming_it(entry, problem):
    with pytest.raises(SectionInvalid) as info:
        DataSection(paths=["a.jsonl"], http_redirect_hosts=["ok.example.com", entry])
    (message,) = [str(p) for p in info.value.exceptions]
    assert message.startswith("http_redirect_hosts: item [1]") and problem in message
