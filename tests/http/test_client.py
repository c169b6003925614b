"""The one HTTP client (`vlmreg.http.client.JsonClient`) against real servers on real sockets: stub servers that
answer 503s, lie, stay silent or drip their answer, and a real ``vlmreg env serve`` for the key.

What is retried (a 503, a dropped connection) and what is not (a 4xx, a 5xx marked ``"retry": false``, a timeout
without a deadline), when it gives up (after the configured retries, or at the deadline), and that every error names
the URL (and the deadline, or the field of an answer outside its schema).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

import vlmreg
from tests.http_stub import StubServer, send
from vlmreg.envs.server import EnvServer
from vlmreg.http.client import AnswerError, HttpError, HttpStatusError, JsonClient, field
from vlmreg.rewards import combine


class Script:
    """A server that answers its requests from ``answers`` in order (the last one again once they run out), and
    records each request's method, path, headers and body."""

    def __init__(self, *answers: tuple[int, object]) -> None:
        self.answers, self.seen = list(answers), []
        script = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.answer(b"")

            def do_POST(self):
                self.answer(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def answer(self, body):
                script.seen.append((self.command, self.path, dict(self.headers), body))
                status, reply = script.answers[min(len(script.seen), len(script.answers)) - 1]
                send(self, status, reply if isinstance(reply, bytes) else json.dumps(reply).encode())

        self.server = StubServer(Handler)
        self.url = self.server.url

    def __enter__(self) -> Script:
        return self

    def __exit__(self, *exc) -> None:
        self.server.close()


BUSY = (503, {"error": {"message": "busy, come back later"}})


def client(url: str, **options) -> JsonClient:
    return JsonClient(url, **{"timeout_s": 5.0, "retries": 3, "backoff_s": 0.01, **options})


# -- retries
# -------------------------------------------------------------------------------------------------------------
def test_a_503_is_retried_and_the_next_answer_returned():
    with Script(BUSY, BUSY, (200, {"ok": 1})) as server:
        assert client(server.url).post("/v1/thing", {"a": 1}) == {"ok": 1}
    assert [(m, p, json.loads(b)) for m, p, _, b in server.seen] == [("POST", "/v1/thing", {"a": 1})] * 3


def test_it_gives_up_after_the_configured_retries_naming_the_url_and_the_last_answer():
    with Script(BUSY) as server, pytest.raises(HttpStatusError) as caught:
        client(server.url, retries=2).get("/health")
    assert len(server.seen) == 3 and caught.value.status == 503 and caught.value.attempts == 3
    assert (
        str(caught.value) == f"{server.url}/health: gave up after 3 attempt(s); last: HTTP 503: busy, come back later"
    )


@pytest.mark.parametrize(
    "status, body",
    [
        (400, {"error": {"message": "messages: is required"}}),
        (404, {"detail": "Not Found"}),
        (500, {"error": {"message": "the game is on fire", "retry": False}}),
    ],
    ids=["400", "404", "500 retry false"],
)
def test_a_4xx_or_a_5xx_marked_not_to_retry_is_not_retried(status, body):
    with Script((status, body), (200, {"ok": 1})) as server, pytest.raises(HttpStatusError) as caught:
        client(server.url).post("/x", {})
    message = body["error"]["message"] if "error" in body else body["detail"]
    assert len(server.seen) == 1 and str(caught.value) == f"{server.url}/x: HTTP {status}: {message}"


def test_a_dead_server_is_retried_then_named():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(
        HttpError, match=rf"^{url}/health: gave up after 2 attempt\(s\); last: cannot connect: .*refused"
    ):
        client(url, retries=1).get("/health")


# -- time
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture
def silent():
    """A server that accepts connections and never answers; it counts them."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", sock
    sock.close()


def test_a_deadline_hit_names_the_url_and_the_deadline(silent):
    url, _ = silent
    started = time.monotonic()
    with pytest.raises(HttpError) as caught:
        client(url, deadline_s=1.0).get("/health")
    assert time.monotonic() - started < 1.5
    assert str(caught.value).startswith(
        f"{url}/health: no good answer within 1 s ("
    ) and "last: no answer within" in str(caught.value)


def test_without_a_deadline_a_timeout_is_not_retried_and_names_the_setting(silent):
    url, listener = silent
    started = time.monotonic()
    with pytest.raises(HttpError) as caught:
        client(url, timeout_s=0.5, timeout_setting="rollout.request_timeout_s").post("/v1/chat/completions", {})
    assert time.monotonic() - started < 1.0  # one attempt, not four
    assert str(caught.value) == f"{url}/v1/chat/completions: no answer within 0.5 s (rollout.request_timeout_s)"


def test_an_answer_dripped_a_byte_at_a_time_is_cut_at_the_attempts_timeout():
    """Every byte arrives inside the timeout, so a per-read socket timeout alone would wait for all 1000 (200 s)."""
    stop = threading.Event()

    class Dripper(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                while not stop.wait(0.2):
                    self.wfile.write(b" ")
                    self.wfile.flush()
            except OSError:
                pass

    server = StubServer(Dripper)
    try:
        started = time.monotonic()
        with pytest.raises(HttpError, match=rf"^{server.url}/slow: no answer within 1 s$"):
            client(server.url, timeout_s=1.0, retries=0).get("/slow")
        assert time.monotonic() - started < 2.0
    finally:
        stop.set()
        server.close()


# -- auth
# ----------------------------------------------------------------------------------------------------------------
def test_the_key_is_sent_as_a_bearer_token():
    with Script((200, {})) as server:
        client(server.url, api_key="s3cret").get("/x")
        client(server.url).get("/y")
    assert server.seen[0][2]["Authorization"] == "Bearer s3cret" and "Authorization" not in server.seen[1][2]


def test_a_server_that_checks_a_key_refuses_the_client_without_it_naming_the_url_and_the_hint():
    spec = vlmreg.get_environment_registry().get("colour_turns")
    server = EnvServer(spec, combine(spec.reward), api_key="right-key-0123456789").start()
    try:
        with pytest.raises(HttpStatusError) as caught:
            client(server.url, api_key="wrong-key", auth_hint=" (check rollout.env_api_key_env)").get("/info")
        assert caught.value.status == 401 and str(caught.value).startswith(
            f"{server.url}/info: HTTP 401: the API key is not this server's"
        )
        assert str(caught.value).endswith("(check rollout.env_api_key_env)")
        assert client(server.url, api_key="right-key-0123456789").get("/info")["name"] == "colour_turns"
    finally:
        server.close()


# -- answers
# -------------------------------------------------------------------------------------------------------------
def test_an_answer_that_is_not_json_is_an_error_naming_the_url_unless_plain_text_is_taken():
    with Script((200, b"<html>hello</html>")) as server:
        with pytest.raises(AnswerError, match=rf"^{server.url}/x: the answer is not JSON: b'<html>hello</html>'"):
            client(server.url).get("/x")
        assert client(server.url, plain_text=True).get("/x") == {"text": "<html>hello</html>"}
        assert len(server.seen) == 2  # not retried


def test_an_answer_larger_than_the_limit_is_refused():
    with (
        Script((200, {"data": "x" * 1000})) as server,
        pytest.raises(AnswerError, match=rf"^{server.url}/x: the answer is larger than 100 bytes"),
    ):
        client(server.url, max_answer_bytes=100).get("/x")


def test_a_field_outside_the_schema_is_named_with_the_url():
    url = "http://h:1/v1/models"
    answer = {"data": [{"id": 7}], "world_size": True}
    with pytest.raises(AnswerError, match=r"^http://h:1/v1/models: the answer has no data\.1$"):
        field(answer, "data.1.id", str, url)
    with pytest.raises(AnswerError, match=r"^http://h:1/v1/models: the answer's data\.0\.id is int 7, not str$"):
        field(answer, "data.0.id", str, url)
    with pytest.raises(AnswerError, match=r"the answer's world_size is bool True, not int"):
        field(answer, "world_size", int, url)
    assert field({"data": [{"id": "m"}]}, "data.0.id", str, url) == "m"
