"""``vlmreg env serve NAME``: one registered environment behind the remote-environment protocol (stdlib HTTP).

Routes (protocol ``vlmreg-env`` version 1; docs/environments.md has the schema): ``GET /health`` (no key needed),
``GET /info``, ``POST /reset``, ``POST /step``, ``POST /close``. Each episode is a session named by the client's
``episode`` id, with its own environment and its own `ImageStore` (released when the episode ends or is closed, or
after ``session_ttl_s`` idle). Retries are safe: a ``/reset`` of a live episode, or a ``/step`` of a turn already
answered, gets the same answer again instead of playing twice.

Hardening is ``vlmreg serve``'s, from the same base (`vlmreg.http.server.HardenedServer`): loopback only without an
API key (unless ``insecure_no_api_key``), the key checked in constant time (``Authorization: Bearer KEY``) on every
route but ``/health`` before anything else, a body limit checked from ``Content-Length`` before reading (413), a
request that must start within ``idle_timeout_s``, arrive within its deadline (``read_timeout_s`` for the request
line and headers, that plus its length at 256 KiB/s for the body: a client that drips bytes is cut off) and whose
every socket read and write is bounded by ``read_timeout_s``; at most ``max_connections`` open connections,
``max_handlers`` requests on a thread and ``max_sessions`` live episodes (past any: 503 with ``Retry-After``),
one-line JSON errors and never a traceback. An environment's own failure is a 500 with ``"retry": false`` (the
client does not replay it).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from vlmreg.data.store import ImageStore
from vlmreg.envs.wire import (
    PROTOCOL,
    PROTOCOL_VERSION,
    ProtocolError,
    decode_images,
    encode_images,
    example_from_json,
    step_to_json,
)
from vlmreg.http.server import HardenedHandler, HardenedServer
from vlmreg.sdk.environment import EnvironmentSpec, EnvStep
from vlmreg.sdk.errors import RequestError, VlmregError
from vlmreg.sdk.version import __version__

__all__ = ["EnvServer", "MAX_BODY_BYTES"]

MAX_BODY_BYTES = 64 << 20
ROUTES = {"/health": "GET", "/info": "GET", "/reset": "POST", "/step": "POST", "/close": "POST"}
_FINISHED_KEPT = 4096  # answers of finished episodes kept for a retried last /step
Log = Callable[[str], None]


class _Refused(RequestError):
    """A refusal in the protocol's terms: ``retry`` tells the client whether to try again; ``headers`` go with it."""

    def __init__(
        self, status: int, message: str, *, retry: bool = False, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(None, message, status=status)
        self.retry, self.headers = retry, dict(headers or {})


class _Handler(HardenedHandler):
    server_version = f"vlmreg-env/{__version__}"
    protocol_version = "HTTP/1.1"


@attrs.define(eq=False)
class _Session:
    env: Any
    store: Any
    example_id: str
    first: dict[str, Any]
    turn: int = 0
    last: dict[str, Any] | None = None
    touched: float = attrs.field(factory=time.monotonic)
    lock: threading.Lock = attrs.field(factory=threading.Lock)


class EnvServer(HardenedServer):
    """Serves ``spec`` on ``host:port`` (``port=0`` picks one); ``reward`` is the reward function its episodes score
    with. ``max_handlers`` (default: ``max_connections``) caps the requests on a thread at once, environment calls
    included."""

    def __init__(
        self,
        spec: EnvironmentSpec,
        reward: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        api_key: str | None = None,
        max_sessions: int = 1024,
        session_ttl_s: float = 600.0,
        call_timeout_s: float = 60.0,
        read_timeout_s: float = 30.0,
        idle_timeout_s: float = 5.0,
        max_connections: int = 256,
        max_handlers: int | None = None,
        insecure_no_api_key: bool = False,
        log: Log | None = None,
    ) -> None:
        super().__init__(
            host,
            port,
            handler=_Handler,
            api_key=api_key,
            insecure_no_api_key=insecure_no_api_key,
            max_connections=max_connections,
            max_handlers=max_connections if max_handlers is None else max_handlers,
            read_timeout_s=read_timeout_s,
            idle_timeout_s=idle_timeout_s,
            max_body_bytes=MAX_BODY_BYTES,
            log=log,
            name="vlmreg-env-serve",
        )
        self.spec, self.reward = spec, reward
        self.max_sessions, self.session_ttl_s, self.call_timeout_s = max_sessions, session_ttl_s, call_timeout_s
        self._sessions: dict[str, _Session] = {}
        self._finished: OrderedDict[tuple[str, int], dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def start(self) -> EnvServer:
        self.serve_in_background()
        return self

    def close(self) -> None:
        super().close()
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            self._close_env(session)

    # -- the routes -----------------------------------------------------------------------
    def route(self, request: HardenedHandler, method: str, path: str) -> tuple[int, Any]:
        if path not in ROUTES:
            raise _Refused(404, f"no route {path}; routes: {', '.join(ROUTES)}")
        if ROUTES[path] != method:
            raise _Refused(405, f"{path} takes {ROUTES[path]}", headers={"Allow": ROUTES[path]})
        if path == "/health":
            return 200, {"status": "ok", "protocol": PROTOCOL, "version": PROTOCOL_VERSION}
        if path == "/info":
            return 200, self.info()
        body = request.json_body()
        if not isinstance(body, dict):
            raise _Refused(400, "the body must be a JSON object")
        try:
            return 200, {"/reset": self.reset, "/step": self.step, "/close": self.close_episode}[path](body)
        except _Refused as exc:
            if self.log is not None:
                self.log(f"{method} {path}: {exc.status} {exc.message}")
            raise
        except (ProtocolError, VlmregError) as exc:  # the body is outside the schema (an image, an example)
            raise _Refused(400, str(exc)) from None

    def error_body(self, error: RequestError) -> dict[str, Any]:
        """The protocol's error: ``{"error": {"message", "retry"}}``; a 503 may be retried unless it says otherwise."""
        return {"error": {"message": str(error), "retry": getattr(error, "retry", error.status == 503)}}

    def info(self) -> dict[str, Any]:
        return {
            "protocol": PROTOCOL,
            "version": PROTOCOL_VERSION,
            "name": self.spec.name,
            "description": self.spec.description,
            "reward": dict(self.spec.reward or {}),
            "max_sessions": self.max_sessions,
            "vlmreg": __version__,
        }

    def reset(self, body: Mapping[str, Any]) -> dict[str, Any]:
        # deferred: start-up cost (loads asyncio)
        from vlmreg.envs.calls import EnvCall, call_environments  # noqa: PLC0415

        episode = _episode_id(body)
        with self._lock:
            existing = self._sessions.get(episode)
            if existing is not None:  # a retried reset: the same first messages
                existing.touched = time.monotonic()
                return existing.first
            self._expire()
            if len(self._sessions) >= self.max_sessions:
                raise _Refused(
                    503,
                    f"{self.max_sessions} episodes are live (--max-sessions); retry later",
                    retry=True,
                    headers={"Retry-After": "1"},
                )
        store = ImageStore(max_feature_bytes=1 << 20)
        decode_images(body.get("images") or {}, store, "reset")
        example = example_from_json(body.get("example"), store, "reset")
        env = self.spec.make(example, self.reward, store)
        try:
            messages = call_environments(
                [EnvCall(env, "reset", (example,), example.id)], timeout_s=self.call_timeout_s, setting="--call-timeout"
            )[0]
        except VlmregError as exc:
            raise _Refused(500, str(exc)) from None
        messages = [dict(m) for m in messages]
        first = {
            "protocol": PROTOCOL,
            "version": PROTOCOL_VERSION,
            "episode": episode,
            "messages": messages,
            "images": encode_images(_ids(messages), store),
        }
        with self._lock:
            self._sessions[episode] = _Session(env, store, example.id, first)
        return first

    def step(self, body: Mapping[str, Any]) -> dict[str, Any]:
        # deferred: start-up cost (loads asyncio)
        from vlmreg.envs.calls import EnvCall, call_environments  # noqa: PLC0415

        episode, turn, completion = _episode_id(body), body.get("turn"), body.get("completion")
        if isinstance(turn, bool) or not isinstance(turn, int) or turn < 1:
            raise _Refused(400, "'turn' must be an integer >= 1 (1 for the first step)")
        if not isinstance(completion, str):
            raise _Refused(400, "'completion' must be a string")
        with self._lock:
            session = self._sessions.get(episode)
            if session is None:
                done = self._finished.get((episode, turn))
                if done is not None:
                    return done
                raise _Refused(
                    404,
                    f"no live episode {episode!r} (never reset, finished, closed or expired after "
                    f"{self.session_ttl_s:g} s idle)",
                )
        with session.lock:
            session.touched = time.monotonic()
            if turn == session.turn and session.last is not None:  # a retried step: the same answer
                return session.last
            if turn != session.turn + 1:
                raise _Refused(
                    409, f"episode {episode!r} is at turn {session.turn}; a step for turn {turn} is out of order"
                )
            try:
                step = call_environments(
                    [EnvCall(session.env, "step", (completion,), session.example_id)],
                    timeout_s=self.call_timeout_s,
                    setting="--call-timeout",
                )[0]
            except VlmregError as exc:
                raise _Refused(500, str(exc)) from None
            if not isinstance(step, EnvStep):
                raise _Refused(500, f"{self.spec.name}.step returned {type(step).__name__}, not an EnvStep")
            answer = {
                "protocol": PROTOCOL,
                "version": PROTOCOL_VERSION,
                "episode": episode,
                "turn": turn,
                **step_to_json(step, session.store),
            }
            session.turn, session.last = turn, answer
        if step.done:
            self._end(episode, answer)
        return answer

    def close_episode(self, body: Mapping[str, Any]) -> dict[str, Any]:
        episode = _episode_id(body)
        with self._lock:
            session = self._sessions.pop(episode, None)
        if session is not None:
            self._close_env(session)
        return {"episode": episode, "closed": session is not None}

    # -- sessions ----------------------------------------------------------------------------
    def _end(self, episode: str, answer: dict[str, Any]) -> None:
        with self._lock:
            session = self._sessions.pop(episode, None)
            self._finished[(episode, answer["turn"])] = answer
            while len(self._finished) > _FINISHED_KEPT:
                self._finished.popitem(last=False)
        if session is not None:
            self._close_env(session)

    def _expire(self) -> None:
        """Drop sessions idle longer than ``session_ttl_s`` (called with the lock held)."""
        now = time.monotonic()
        for episode in [e for e, s in self._sessions.items() if now - s.touched > self.session_ttl_s]:
            self._close_env(self._sessions.pop(episode))

    @staticmethod
    def _close_env(session: _Session) -> None:
        close = getattr(session.env, "close", None)
        if callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001 - the episode is over either way
                pass

    @property
    def live_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)


def _episode_id(body: Mapping[str, Any]) -> str:
    episode = body.get("episode")
    if not isinstance(episode, str) or not 0 < len(episode) <= 200:
        raise _Refused(400, "'episode' must be a non-empty string of at most 200 characters (the client's episode id)")
    return episode


def _ids(messages: Any) -> list[str]:
    return [
        p["image"]
        for m in messages
        if not isinstance(m["content"], str)
        for p in m["content"]
        if p.get("type") == "image"
    ]
