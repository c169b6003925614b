"""Fetching an image's bytes over HTTP(S), bounded: a wall-clock deadline and a size limit for the whole fetch, and
every redirect checked against the rules of the first URL.

`fetch_url` is what `vlmreg.data.images.decode_image` calls for an ``http(s)://`` string; it is imported only then.
"""

from __future__ import annotations

import math
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPConnection, HTTPException, HTTPSConnection
from typing import Any

from vlmreg.data.image_limits import ImageError, ImageLimits, check_encoded_size

__all__ = ["fetch_url"]

_CHUNK = 64 * 1024
_MAX_REDIRECTS = 5


class _FetchAborted(Exception):
    """Raised in the fetch thread when the caller gave up (the deadline passed) while it was connecting."""


class _Connections:
    """The sockets one fetch opened, so the caller can close them when the deadline passes.

    Closing a socket makes a thread blocked in ``recv`` on it return at once: that is how a server that drips
    its headers or body a byte at a time is cut off (urllib's ``timeout`` bounds each socket wait, not the fetch).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: list[Any] = []
        self._closed = False

    def connection_class(self, base: type[HTTPConnection]) -> Any:
        tracker = self

        class Tracked(base):  # type: ignore[misc, valid-type]
            def connect(self) -> None:
                super().connect()
                tracker.add(self.sock)

        return Tracked

    def add(self, sock: Any) -> None:
        with self._lock:
            self._sockets.append(sock)
            if not self._closed:
                return
        _close_socket(sock)
        raise _FetchAborted

    def close_all(self) -> None:
        with self._lock:
            self._closed = True
            sockets = list(self._sockets)
        for sock in sockets:
            _close_socket(sock)


def _close_socket(sock: Any) -> None:
    for step in (lambda: sock.shutdown(socket.SHUT_RDWR), sock.close):
        try:
            step()
        except OSError:
            pass


class _TrackedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, connections: _Connections) -> None:
        super().__init__()
        self._connection = connections.connection_class(HTTPConnection)

    def http_open(self, req: Any) -> Any:
        return self.do_open(self._connection, req)


class _TrackedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, connections: _Connections) -> None:
        super().__init__()
        self._connection = connections.connection_class(HTTPSConnection)

    def https_open(self, req: Any) -> Any:
        return self.do_open(self._connection, req, context=self._context)  # type: ignore[attr-defined]  # CPython's HTTPSHandler keeps it there; typeshed omits it


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _host_port(url: str) -> tuple[str, int, bool]:
    """``url``'s host name (lower case), its port and whether that port is its scheme's default."""
    parts = urllib.parse.urlsplit(url)
    default = _DEFAULT_PORTS.get(parts.scheme.lower(), 0)
    try:
        port = parts.port
    except ValueError:  # a port that is not a number, or out of range
        port = -1
    port = default if port is None else port
    return (parts.hostname or "").lower(), port, port == default


def _host_rule(entry: str) -> tuple[str, int | None]:
    """An ``http_redirect_hosts`` entry (``name`` or ``name:port``; ``[v6]`` too) as (host name, port or None)."""
    parts = urllib.parse.urlsplit("//" + entry.strip())
    return (parts.hostname or "").lower(), parts.port


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Each redirect is checked against the rules of the first URL before it is followed: at most 5 of them, only
    to ``http(s)://`` (never ``file://``, ``ftp://``, ...), and only to the first URL's host (the same name and port;
    ``http`` to ``https`` on the default ports counts as the same) or one that ``redirect_hosts`` names."""

    max_redirections = _MAX_REDIRECTS

    def __init__(self, first_url: str, redirect_hosts: tuple[str, ...]) -> None:
        super().__init__()
        self.followed = 0
        self.origin = _host_port(first_url)
        self.allowed = [_host_rule(entry) for entry in redirect_hosts]

    def _refusal(self, newurl: str) -> str | None:
        scheme = newurl.split(":", 1)[0].lower()
        if scheme not in ("http", "https"):
            return f"redirect to {_shorten(newurl)} refused (only http(s) is fetched)"
        host, port, default = _host_port(newurl)
        first_host, first_port, first_default = self.origin
        if host == first_host and (port == first_port or (default and first_default)):
            return None
        if any(host == name and rule_port in (None, port) for name, rule_port in self.allowed):
            return None
        where = f"{first_host}:{first_port}"
        return (
            f"redirect to {_shorten(newurl)} refused: it leaves {where} for another host "
            "(to allow it, add that host to [data] http_redirect_hosts)"
        )

    def http_error_302(self, req: Any, fp: Any, code: int, msg: str, headers: Any) -> Any:
        target = headers.get("location") or headers.get("uri")
        if target:
            newurl = urllib.parse.urljoin(req.full_url, target.strip())
            refusal = self._refusal(newurl)
            if refusal is not None:
                fp.close()
                raise urllib.error.URLError(refusal)
            self.followed += 1
            if self.followed > _MAX_REDIRECTS:
                fp.close()
                raise urllib.error.URLError(f"more than {_MAX_REDIRECTS} redirects (the last to {_shorten(newurl)})")
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _opener(connections: _Connections, url: str, redirect_hosts: tuple[str, ...]) -> urllib.request.OpenerDirector:
    """An opener that speaks only HTTP(S): no file://, ftp:// or data: handlers, unlike urlopen's."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(),
        _TrackedHTTPHandler(connections),
        _TrackedHTTPSHandler(connections),
        _CheckedRedirects(url, redirect_hosts),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


def _shorten(url: str) -> str:
    return url if len(url) <= 200 else url[:200] + "..."


def fetch_url(url: str, scheme: str, limits: ImageLimits, where: str) -> bytes:
    """GET ``url`` within ``max_bytes`` (checked as it streams) and ``http_timeout_s``, a wall-clock deadline.

    The deadline covers the whole fetch: DNS, connect, every redirect, the headers and the body. The request
    runs in a worker thread; when the deadline passes, its sockets are closed (which ends it) and the fetch fails.
    """
    shown = _shorten(url)
    if scheme not in ("http", "https"):
        raise ImageError(
            where, f"{scheme}:// URLs are not allowed ({shown}); use a local path, a data: URI or http(s)://"
        )
    if not limits.allow_http:
        raise ImageError(
            where, f"fetching {limits.kind}s over HTTP is off ({shown}); set allow_http = true in [data] to allow it"
        )
    timeout = limits.http_timeout_s
    bounded = math.isfinite(timeout)
    deadline = time.monotonic() + timeout if bounded else math.inf
    expired = f"timed out after {timeout:g} s fetching {shown}"  # the deadline: connect, headers and body together
    connections = _Connections()
    outcome: dict[str, Any] = {}

    def fetch() -> None:
        try:
            outcome["data"] = _get(url, limits, where, connections, timeout if bounded else None, deadline)
        except BaseException as exc:  # handed to the caller's thread, which decides what it means
            outcome["error"] = exc

    worker = threading.Thread(target=fetch, name=f"vlmreg-fetch {shown[:60]}", daemon=True)
    worker.start()
    worker.join(timeout if bounded else None)
    if worker.is_alive():
        connections.close_all()  # the worker's recv returns; it ends on its own
        raise ImageError(where, expired)
    if "data" in outcome:
        return outcome["data"]
    exc = outcome["error"]
    if isinstance(exc, ImageError):
        raise exc
    if isinstance(exc, urllib.error.HTTPError):
        raise ImageError(where, f"HTTP {exc.code} {exc.reason} from {shown}") from None
    if isinstance(exc, urllib.error.URLError):
        if isinstance(exc.reason, TimeoutError):
            raise ImageError(where, expired) from None
        raise ImageError(where, f"cannot fetch {shown}: {exc.reason}") from None
    if isinstance(exc, (TimeoutError, _FetchAborted)):
        raise ImageError(where, expired) from None
    if isinstance(exc, (HTTPException, OSError, ValueError)):
        raise ImageError(where, f"cannot fetch {shown}: {exc or type(exc).__name__}") from None
    raise exc


def _get(
    url: str, limits: ImageLimits, where: str, connections: _Connections, timeout: float | None, deadline: float
) -> bytes:
    """The fetch itself (run in the worker thread): each socket wait is bounded too, and the deadline checked per
    chunk."""
    request = urllib.request.Request(url, headers={"User-Agent": "vlmreg", "Accept": f"{limits.kind}/*"})
    with _opener(connections, url, limits.redirect_hosts).open(request, timeout=timeout) as response:
        declared = response.headers.get("Content-Length")
        if declared and declared.isdigit():
            check_encoded_size(int(declared), limits, where)
        chunks: list[bytes] = []
        received = 0
        while chunk := response.read1(_CHUNK):  # read1: return what has arrived, so the deadline is checked
            received += len(chunk)
            check_encoded_size(received, limits, where, at_least=True)
            if time.monotonic() > deadline:
                raise TimeoutError
            chunks.append(chunk)
    return b"".join(chunks)
