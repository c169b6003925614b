"""Remote environments: `vlmreg env serve`'s server and the trainer's client, in one process and against lying,
slow and dead servers. Every failure is a clear error naming the environment server, never a hang."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler

import pytest
from PIL import Image

import vlmreg
from tests.http_stub import StubServer, send
from vlmreg import EnvironmentSpec
from vlmreg.data import ImageStore
from vlmreg.envs.remote import RemoteEnvironmentError, RemoteEnvironments
from vlmreg.envs.server import EnvServer
from vlmreg.envs.wire import PROTOCOL, PROTOCOL_VERSION
from vlmreg.rewards import combine
from vlmreg.rollout.episodes import EnvironmentFailure, run_episodes
from vlmreg.sdk.engine import ChatTurn, Completion, EncodedPrompt, SamplingParams
from vlmreg.sdk.environment import EnvStep
from vlmreg.tasks import colour_turns


class Says:
    """A text engine answering every conversation with ``text``; it records what it was shown."""

    def __init__(self, text):
        self.text, self.seen = text, []

    def chat(self, conversations, params, *, template_kwargs=None, names=None):
        self.seen += [list(c) for c in conversations]
        return [
            ChatTurn(EncodedPrompt([1], [], [], ""), Completion([2], [-1.0], "stop"), self.text) for _ in conversations
        ]


@pytest.fixture
def served():
    spec = vlmreg.get_environment_registry().get("colour_turns")
    server = EnvServer(spec, combine(spec.reward), api_key="sesame", max_sessions=8).start()
    yield server
    server.close()


def client(url, store, **kwargs):
    return RemoteEnvironments(url, store, **{"api_key": "sesame", "timeout_s": 5.0, "retries": 2, **kwargs})


def post(url, path, body, key="sesame"):
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_colour_turns_played_remotely_gives_what_it_gives_in_process(served):
    store = ImageStore()
    examples = colour_turns.generate(4, 3, store)
    remote = client(served.url, store, name="colour_turns")
    info = remote.verify(examples[0])
    assert info["protocol"] == PROTOCOL and info["version"] == PROTOCOL_VERSION and info["name"] == "colour_turns"
    pairs = [(e, i) for i, e in enumerate(examples)]
    engine = Says("Red")
    far = run_episodes(pairs, remote.make, engine, SamplingParams(), max_images_per_message=1)
    spec = vlmreg.get_environment_registry().get("colour_turns")
    near = run_episodes(
        pairs,
        lambda e: spec.make(e, combine(spec.reward), store),
        Says("Red"),
        SamplingParams(),
        max_images_per_message=1,
    )
    assert [t.reward for t in far] == [t.reward for t in near] and [len(t.turns) for t in far] == [3] * 4
    # the later images came back over the wire, under their content ids, into the trainer's store
    shown = [
        p["image"]
        for m in engine.seen[-1]
        if not isinstance(m["content"], str)
        for p in m["content"]
        if p.get("type") == "image"
    ]
    assert shown[1:] == examples[-1].metadata["later_images"]
    assert served.live_sessions == 0  # finished episodes (and the dry run) are released


def test_retries_are_safe_a_step_replayed_gets_the_same_answer(served):
    store = ImageStore()
    [example] = colour_turns.generate(1, 0, store)
    remote = client(served.url, store)
    remote.verify(example)
    env = remote.make(example)
    env.reset(example)
    first = env.step("Blue")
    again = post(served.url, "/step", {"episode": env.episode, "turn": 1, "completion": "Red"})[1]
    assert (
        again["reward"] == first.reward
        and again["messages"][0]["content"][0]["image"] == first.messages[0]["content"][0]["image"]
    )
    status, body = post(served.url, "/step", {"episode": env.episode, "turn": 3, "completion": "Red"})
    assert status == 409 and "out of order" in body["error"]["message"]


def test_the_server_refuses_bad_requests_with_a_status_and_one_line(served):
    assert post(served.url, "/reset", {"episode": "x"}, key="wrong")[0] == 401
    status, body = post(served.url, "/reset", {"episode": 5})
    assert status == 400 and "'episode' must be" in body["error"]["message"]
    assert post(served.url, "/nope", {})[0] == 404
    status, body = post(served.url, "/step", {"episode": "never", "turn": 1, "completion": "Red"})
    assert status == 404 and "no live episode" in body["error"]["message"]
    status, body = post(
        served.url,
        "/reset",
        {
            "episode": "e1",
            "example": {"id": "x", "messages": [{"role": "user", "content": [{"type": "image", "image": "abc"}]}]},
        },
    )
    assert status == 400 and "not in 'images'" in body["error"]["message"]
    with urllib.request.urlopen(served.url + "/health", timeout=5) as response:  # no key needed
        assert json.loads(response.read())["status"] == "ok"
    request = urllib.request.Request(
        served.url + "/step",
        data=b"x",
        method="POST",
        headers={"Content-Length": str(1 << 30), "Authorization": "Bearer sesame"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=5)
    assert caught.value.code == 413


def test_too_many_live_episodes_is_a_503_with_retry_after(served):
    store = ImageStore()
    [example] = colour_turns.generate(1, 0, store)
    remote = client(served.url, store, retries=0, timeout_s=2.0)
    envs = [remote.make(example) for _ in range(8)]
    for env in envs:
        env.reset(example)
    with pytest.raises(RemoteEnvironmentError, match=r"POST /reset: .*HTTP 503: 8 episodes are live"):
        remote.make(example).reset(example)
    envs[0].close()
    remote.make(example).reset(example)


def test_a_wrong_api_key_is_refused_before_training_with_the_reason(served):
    store = ImageStore()
    [example] = colour_turns.generate(1, 0, store)
    with pytest.raises(
        RemoteEnvironmentError,
        match=r"failed its check before training: environment server .*: GET /info: HTTP 401: "
        r".*rollout.env_api_key_env",
    ):
        client(served.url, store, api_key="nope").verify(example)
    with pytest.raises(
        RemoteEnvironmentError, match="serves environment 'colour_turns', but the run asks for 'crafter'"
    ):
        client(served.url, store, name="crafter").verify(example)


# -- dead, slow and lying servers ------------------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_server_is_a_clear_error_after_retries_not_a_hang():
    store = ImageStore()
    [example] = colour_turns.generate(1, 0, store)
    url = f"http://127.0.0.1:{free_port()}"
    started = time.perf_counter()
    with pytest.raises(
        RemoteEnvironmentError,
        match=rf"environment server {url}: GET /health: no good answer within 3 s \(3 attempt\(s\); last: .*Connection",
    ):
        client(url, store, timeout_s=3.0).verify(example)
    assert time.perf_counter() - started < 3.5


@pytest.fixture
def silent():
    """A server that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_a_silent_server_times_out_by_its_deadline(silent):
    store = ImageStore()
    [example] = colour_turns.generate(1, 0, store)
    started = time.perf_counter()
    with pytest.raises(
        RemoteEnvironmentError, match=rf"environment server {silent}: GET /health: no good answer within 1 s"
    ):
        client(silent, store, timeout_s=1.0).verify(example)
    assert time.perf_counter() - started < 2


class Liar:
    """An environment server that breaks the protocol in one chosen way."""

    def __init__(self, how):
        self.how, self.calls = how, 0
        liar = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.answer()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.answer()

            def answer(self):
                liar.calls += 1
                status, body = liar.reply(self.path)
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                send(self, status, data)

        self.server = StubServer(Handler)
        self.url = self.server.url

    def reply(self, path):
        info = {"protocol": PROTOCOL, "version": PROTOCOL_VERSION, "name": "colour_turns"}
        if path == "/health":
            return 200, {"status": "ok"}
        if path == "/info":
            return (200, {**info, "version": 99}) if self.how == "version" else (200, info)
        if self.how == "500":
            return 500, {"error": {"message": "the game server is on fire"}}
        if path == "/reset":
            if self.how == "not json":
                return 200, b"<html>hello</html>"
            if self.how == "image id":
                return 200, {
                    "messages": [{"role": "user", "content": [{"type": "image", "image": "0" * 24}]}],
                    "images": {"0" * 24: PNG},
                }
            return 200, {"messages": [{"role": "user", "content": "go"}], "images": {}}
        if path == "/step":
            return 200, {"reward": "lots", "done": True} if self.how == "schema" else {
                "reward": 1.0,
                "done": False,
                "messages": [],
            }
        return 200, {}

    def close(self):
        self.server.close()


def _png():
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


PNG = _png()


@pytest.mark.parametrize(
    "how, message",
    [
        ("version", r"speaks protocol 'vlmreg-env' version 99; this trainer speaks 'vlmreg-env' version 1"),
        (
            "500",
            r"POST /reset: no good answer within 2 s \(3 attempt\(s\); last: HTTP 500: the game server is on fire\)",
        ),
        ("not json", r"POST /reset: the answer is not JSON"),
        ("image id", r"POST /reset: images\['000000000000000000000000'\] holds an image whose content id is"),
    ],
)
def test_a_lying_server_fails_the_check_before_training(how, message):
    liar = Liar(how)
    store = ImageStore()
    [example] = colour_turns.generate(1, 0, store)
    try:
        with pytest.raises(
            RemoteEnvironmentError, match=rf"failed its check before training: environment server {liar.url}: {message}"
        ):
            client(liar.url, store, timeout_s=2.0).verify(example)
    finally:
        liar.close()
    if how == "500":
        assert liar.calls == 2 + 3  # health, info, then the reset tried three times


@pytest.mark.parametrize(
    "how, message",
    [
        ("schema", r"'reward' must be a finite number, got 'lots'"),
        ("empty", r"an answer that is not done must carry the next 'messages'"),
    ],
)
def test_a_step_outside_the_schema_is_an_error_naming_the_server_and_the_episode(how, message):
    liar = Liar(how)
    store = ImageStore()
    [example] = colour_turns.generate(1, 0, store)
    remote = client(liar.url, store, timeout_s=2.0)
    remote.verify(example)
    try:
        with pytest.raises(
            EnvironmentFailure,
            match=rf"remote environment colour_turns at {liar.url}\.step failed on colour_turns:0: environment server "
            rf"{liar.url}: POST /step: {message}",
        ):
            run_episodes([(example, 0)], remote.make, Says("Red"), SamplingParams(), max_images_per_message=1)
    finally:
        liar.close()


def test_the_last_step_of_a_finished_episode_can_be_replayed_and_idle_episodes_expire():
    spec = vlmreg.get_environment_registry().get("colour_turns")
    server = EnvServer(spec, combine(spec.reward), session_ttl_s=0.2).start()
    try:
        store = ImageStore()
        [example] = colour_turns.generate(1, 0, store)
        remote = client(server.url, store, api_key=None)
        env = remote.make(example)
        env.reset(example)
        last = [env.step("Red") for _ in range(3)][-1]
        assert last.done and server.live_sessions == 0
        status, again = post(server.url, "/step", {"episode": env.episode, "turn": 3, "completion": "Blue"})
        assert status == 200 and again["done"] is True and again["reward"] == last.reward
        idle = remote.make(example)
        idle.reset(example)
        time.sleep(0.3)
        remote.make(example).reset(example)  # a reset sweeps idle episodes
        status, body = post(server.url, "/step", {"episode": idle.episode, "turn": 1, "completion": "Red"})
        assert status == 404 and "expired after 0.2 s idle" in body["error"]["message"]
    finally:
        server.close()


class Sleepy:
    """An environment whose step takes ``pause`` seconds."""

    pause = 1.0

    def __init__(self, example, reward, store):
        pass

    def reset(self, example):
        return [{"role": "user", "content": "go"}]

    def step(self, completion):
        time.sleep(Sleepy.pause)

        return EnvStep(reward=1.0, done=True)


def test_a_slow_environment_is_a_500_not_retried_and_a_busy_server_a_503():
    spec = EnvironmentSpec(name="sleepy", make=Sleepy)
    server = EnvServer(spec, None, call_timeout_s=0.3, max_connections=1).start()
    try:
        store = ImageStore()
        [example] = colour_turns.generate(1, 0, store)
        remote = client(server.url, store, api_key=None, timeout_s=5.0)
        env = remote.make(example)
        env.reset(example)
        started = time.perf_counter()
        with pytest.raises(
            RemoteEnvironmentError,
            match=r"POST /step: HTTP 500: Sleepy.step failed on colour_turns:0: no answer within 0.3 s "
            r"\(--call-timeout\)",
        ):
            env.step("Red")
        assert time.perf_counter() - started < 2  # not retried: the environment itself failed
        server.call_timeout_s = 5.0
        busy = remote.make(example)
        busy.reset(example)
        worker = threading.Thread(target=busy.step, args=("Red",))
        worker.start()
        time.sleep(0.3)  # the one connection slot is taken by that step
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(server.url + "/info", timeout=5)
        assert caught.value.code == 503 and caught.value.headers["Retry-After"] == "1"
        worker.join()
    finally:
        server.close()


def test_wrong_method_and_missing_length_are_refused(served):
    request = urllib.request.Request(served.url + "/reset", method="GET", headers={"Authorization": "Bearer sesame"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=5)
    assert caught.value.code == 405
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /reset HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sesame\r\n\r\n")
        assert b" 411 " in sock.recv(200).split(b"\r\n", 1)[0]


def test_an_episode_dropped_without_close_is_closed_on_the_server(served):
    """The format warm-up only asks for first prompts and drops the environment: the session must not linger."""
    store = ImageStore()
    [example] = colour_turns.generate(1, 0, store)
    remote = client(served.url, store)
    remote.make(example).reset(example)  # dropped at once
    deadline = time.monotonic() + 5
    while served.live_sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.live_sessions == 0
