"""Safe image decoding: bytes, base64, ``data:`` URIs, local files and (when allowed) ``http(s)://`` URLs.

Dataset images come from files nobody has looked at, so every step is bounded before it costs anything:
the encoded size is checked before a file is read or a base64 string is decoded, and while an HTTP body
streams in; the pixel count is read from the image header and checked *before* pixels are decoded
(a 100-byte PNG can claim 10^10 pixels); only common raster formats are opened (Pillow's EPS plugin,
for one, would run Ghostscript); and the whole image is decoded at once, so a truncated or corrupt
file fails here, naming its record, instead of inside a training step.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import re
import socket
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from http.client import HTTPConnection, HTTPException, HTTPSConnection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from vlmreg.sdk.errors import VlmregError

if TYPE_CHECKING:
    from PIL import Image as PILImage

    from vlmreg.config.schema import DataSection

__all__ = ["ImageError", "ImageLimits", "ImagePathError", "ImageSource", "decode_image"]

ImageSource = bytes | bytearray | memoryview | str
"""What `decode_image` takes: encoded bytes, or a string (``data:`` URI, URL, base64 text or file path)."""

# Formats opened at all; anything else is "not an image" (no EPS/Ghostscript, no exotic decoders).
ALLOWED_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
# How base64 text of each allowed format begins: a string starting so is base64, not a file name.
_BASE64_SIGNATURES = ("iVBORw0KGgo", "/9j/", "R0lGOD", "UklGR", "Qk", "SUkq", "TU0AK")
_LONGEST_PATH = 4096  # a longer string is base64 text, never a path
_BASE64_TEXT = re.compile(r"[A-Za-z0-9+/\s]{64,}={0,2}\s*")
_URL_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_DATA_URI = re.compile(r"^data:([^,;]*)((?:;[^,;]*)*?),", re.S)
_CHUNK = 64 * 1024


class ImageError(VlmregError, ValueError):
    """An image that cannot or may not be decoded; the one-line message names where it came from and why."""

    def __init__(self, where: str, reason: str) -> None:
        self.where, self.reason = where, " ".join(reason.split())
        super().__init__(f"{where}: {self.reason}" if where else self.reason)


class ImagePathError(ImageError):
    """A local image path (or ``file://`` URI) that resolves outside the allowed folders: refused, never opened."""


def _roots(value: Any) -> tuple[Path, ...] | None:
    return None if value is None else tuple(Path(root) for root in value)


@attrs.frozen(kw_only=True)
class ImageLimits:
    """What `decode_image` accepts. ``base_dir`` anchors relative paths (the dataset file's folder).

    ``roots``: ``None`` reads local paths as given (a trusted caller); a tuple of folders confines them: a path
    (or a ``file://`` URI) must resolve, symlinks followed, inside one of them, else it is refused (`ImagePathError`)
    before it is opened. ``()`` refuses every local path.

    ``redirect_hosts``: hosts (``name``, any port, or ``name:port``) an HTTP fetch may be redirected to besides the
    first URL's own; any other redirect is refused.
    """

    max_bytes: int = attrs.field(default=20_000_000, validator=attrs.validators.gt(0))
    max_pixels: int = attrs.field(default=40_000_000, validator=attrs.validators.gt(0))
    allow_http: bool = False
    http_timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    base_dir: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    roots: tuple[Path, ...] | None = attrs.field(default=None, converter=_roots)
    redirect_hosts: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @classmethod
    def from_section(
        cls, section: DataSection, base_dir: str | Path | None = None, *, roots: Any = None
    ) -> ImageLimits:
        """The limits a ``[data]`` section sets, with relative image paths resolved against ``base_dir``
        (and confined to ``roots``, resolved folders, when given)."""
        return cls(
            max_bytes=section.max_image_bytes,
            max_pixels=section.max_image_pixels,
            allow_http=section.allow_http,
            http_timeout_s=section.http_timeout_s,
            base_dir=base_dir,
            roots=roots,
            redirect_hosts=tuple(section.http_redirect_hosts),
        )


def decode_image(source: ImageSource, *, limits: ImageLimits, where: str) -> PILImage.Image:
    """Decode one image to an RGB PIL image, fully loaded, or raise `ImageError` naming ``where``.

    A string is read as a ``data:`` URI when it starts with ``data:``; as a URL when it has a scheme
    (``http``/``https`` only, and only with ``limits.allow_http``); as base64 text when it starts the way
    base64 of a PNG/JPEG/GIF/WebP/BMP/TIFF does or is longer than any path; otherwise as a file path.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        _check_size(memoryview(source).nbytes, limits, where)
        data = bytes(source)
    elif isinstance(source, str):
        data = _read_string(source, limits, where)
    else:
        raise ImageError(where, f"expected image bytes or a string, got {type(source).__name__}")
    return _decode_bytes(data, limits, where)


# -- getting the encoded bytes ----------------------------------------------------------------------
def _check_size(size: int, limits: ImageLimits, where: str, *, at_least: bool = False) -> None:
    if size > limits.max_bytes:
        amount = f"more than {limits.max_bytes}" if at_least else f"{size}"
        raise ImageError(where, f"image is {amount} bytes, more than max_image_bytes ({limits.max_bytes})")


def _read_string(text: str, limits: ImageLimits, where: str) -> bytes:
    if text.startswith("data:"):
        return _read_data_uri(text, limits, where)
    scheme = _URL_SCHEME.match(text)
    if scheme and scheme.group(1).lower() == "file" and limits.roots is not None:
        return _read_file(_file_uri_path(text, where), limits, where)  # confined: a file:// URI is a path
    if scheme:
        return _fetch_url(text, scheme.group(1).lower(), limits, where)
    stripped = text.strip()
    if len(stripped) > _LONGEST_PATH or (stripped.startswith(_BASE64_SIGNATURES) and "." not in stripped):
        return _decode_base64(stripped, limits, where)
    return _read_file(text, limits, where)


def _decode_base64(text: str, limits: ImageLimits, where: str) -> bytes:
    clean = "".join(text.split())
    # The decoded size follows from the text's length: check it before decoding any of it.
    _check_size(len(clean) * 3 // 4 - clean[-2:].count("="), limits, where)
    try:
        return base64.b64decode(clean, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(where, f"not valid base64 ({exc})") from None


def _read_data_uri(text: str, limits: ImageLimits, where: str) -> bytes:
    match = _DATA_URI.match(text[:512])
    if not match:
        raise ImageError(where, "malformed data: URI (expected data:image/<type>;base64,<data>)")
    mime, params = match.group(1).strip().lower(), match.group(2).lower().split(";")
    if mime and not mime.startswith("image/"):
        raise ImageError(where, f"data: URI has media type {mime!r}, not an image type")
    if "base64" not in [p.strip() for p in params]:
        raise ImageError(where, "data: URI is not base64-encoded (expected ;base64,)")
    return _decode_base64(text[match.end():], limits, where)


def _file_uri_path(text: str, where: str) -> str:
    """The local path a ``file://`` URI names (``file:///abs/path`` or ``file://localhost/abs/path``)."""
    parts = urllib.parse.urlsplit(text)
    if parts.netloc not in ("", "localhost"):
        raise ImagePathError(where, f"file:// URI {text!r} names host {parts.netloc!r}; only local files (file:///path) are read")
    return urllib.request.url2pathname(parts.path)


def _inside(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path.is_relative_to(root) for root in roots)


def _outside(text: str, real: Path, roots: tuple[Path, ...], where: str) -> ImagePathError:
    allowed = ", ".join(str(root) for root in roots) or "none"
    return ImagePathError(
        where,
        f"image path {text!r} resolves to {real}, outside the allowed image folders ({allowed}); "
        "to allow it, add its folder to [data] image_roots",
    )


def _read_confined_file(text: str, path: Path, roots: tuple[Path, ...], limits: ImageLimits, where: str) -> bytes:
    """Read ``path`` only if it resolves (symlinks followed) inside ``roots``; the resolved file is what is opened."""
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        try:
            loose = path.resolve()  # a missing file outside the roots is refused, not reported as missing
        except (OSError, RuntimeError, ValueError):
            loose = None
        if loose is not None and not _inside(loose, roots):
            raise _outside(text, loose, roots, where) from None
        hint = " (nor base64 of a PNG, JPEG, GIF, WebP, BMP or TIFF image)" if _BASE64_TEXT.fullmatch(text) else ""
        raise ImageError(where, f"image file not found: {path}{hint}") from None
    except RuntimeError:  # a symlink loop (Python 3.11)
        raise ImageError(where, f"cannot read image file {path}: symlink loop") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ImageError(where, f"cannot read image file {path!s}: {getattr(exc, 'strerror', None) or exc}") from None
    if not _inside(real, roots):
        raise _outside(text, real, roots, where)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)  # the checked, symlink-free path; O_NONBLOCK: a FIFO swapped in cannot hang us
    except OSError as exc:
        raise ImageError(where, f"cannot read image file {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ImageError(where, f"not a file: {path}")
        _check_size(info.st_size, limits, where)
        try:
            data = handle.read(limits.max_bytes + 1)
        except OSError as exc:
            raise ImageError(where, f"cannot read image file {path}: {exc.strerror or exc}") from None
    _check_size(len(data), limits, where, at_least=True)  # the file grew after fstat
    return data


def _read_file(text: str, limits: ImageLimits, where: str) -> bytes:
    path = Path(text).expanduser()
    if not path.is_absolute() and limits.base_dir is not None:
        path = limits.base_dir / path
    if limits.roots is not None:
        return _read_confined_file(text, path, limits.roots, limits, where)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        hint = " (nor base64 of a PNG, JPEG, GIF, WebP, BMP or TIFF image)" if _BASE64_TEXT.fullmatch(text) else ""
        raise ImageError(where, f"image file not found: {path}{hint}") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ImageError(where, f"cannot read image file {path!s}: {getattr(exc, 'strerror', None) or exc}") from None
    if not path.is_file():
        raise ImageError(where, f"not a file: {path}")
    _check_size(size, limits, where)
    try:
        with path.open("rb") as handle:
            data = handle.read(limits.max_bytes + 1)
    except OSError as exc:
        raise ImageError(where, f"cannot read image file {path}: {exc.strerror or exc}") from None
    _check_size(len(data), limits, where, at_least=True)  # the file grew after stat
    return data


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
        return self.do_open(self._connection, req, context=self._context)


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
        return (f"redirect to {_shorten(newurl)} refused: it leaves {where} for another host "
                "(to allow it, add that host to [data] http_redirect_hosts)")

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


def _fetch_url(url: str, scheme: str, limits: ImageLimits, where: str) -> bytes:
    """GET ``url`` within ``max_bytes`` (checked as it streams) and ``http_timeout_s``, a wall-clock deadline.

    The deadline covers the whole fetch: DNS, connect, every redirect, the headers and the body. The request
    runs in a worker thread; when the deadline passes, its sockets are closed (which ends it) and the fetch fails.
    """
    shown = _shorten(url)
    if scheme not in ("http", "https"):
        raise ImageError(where, f"{scheme}:// URLs are not allowed ({shown}); use a local path, a data: URI or http(s)://")
    if not limits.allow_http:
        raise ImageError(where, f"fetching images over HTTP is off ({shown}); set allow_http = true in [data] to allow it")
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


def _get(url: str, limits: ImageLimits, where: str, connections: _Connections, timeout: float | None, deadline: float) -> bytes:
    """The fetch itself (run in the worker thread): each socket wait is bounded too, and the deadline checked per chunk."""
    request = urllib.request.Request(url, headers={"User-Agent": "vlmreg", "Accept": "image/*"})
    with _opener(connections, url, limits.redirect_hosts).open(request, timeout=timeout) as response:
        declared = response.headers.get("Content-Length")
        if declared and declared.isdigit():
            _check_size(int(declared), limits, where)
        chunks: list[bytes] = []
        received = 0
        while chunk := response.read1(_CHUNK):  # read1: return what has arrived, so the deadline is checked
            received += len(chunk)
            _check_size(received, limits, where, at_least=True)
            if time.monotonic() > deadline:
                raise TimeoutError
            chunks.append(chunk)
    return b"".join(chunks)


# -- decoding ---------------------------------------------------------------------------------------
def _decode_bytes(data: bytes, limits: ImageLimits, where: str) -> PILImage.Image:
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not data:
        raise ImageError(where, "empty image data")
    try:
        with warnings.catch_warnings():
            # Our own limit, checked just below, is the one that decides; Pillow's warning is noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
    except UnidentifiedImageError:
        raise ImageError(where, f"not an image (or not one of {', '.join(ALLOWED_FORMATS)})") from None
    except Image.DecompressionBombError as exc:  # Pillow's own limit, checked as it opens: far above ours
        raise ImageError(
            where, f"refused as a decompression bomb, more than max_image_pixels ({limits.max_pixels}): {exc}"
        ) from None
    except Exception as exc:  # Pillow raises many types on malformed input (struct.error, SyntaxError, ...)
        raise ImageError(where, f"corrupt {_kind(data)} image: {_describe(exc)}") from None
    with image:
        width, height = image.size
        if width * height > limits.max_pixels:
            raise ImageError(
                where,
                f"image is {width}x{height} = {width * height} pixels, more than max_image_pixels ({limits.max_pixels})",
            )
        if width == 0 or height == 0:
            raise ImageError(where, f"image has no pixels ({width}x{height})")
        try:
            image.load()  # decode every pixel now: a truncated file fails here, not in a training step
            rgb = ImageOps.exif_transpose(image).convert("RGB")
        except Exception as exc:  # see above: any failure to decode is a bad image, reported as such
            raise ImageError(where, f"corrupt or truncated {image.format} image: {_describe(exc)}") from None
    return rgb


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _kind(data: bytes) -> str:
    """A format name from the magic bytes, for messages about files Pillow could not even open."""
    for magic, name in ((b"\x89PNG", "PNG"), (b"\xff\xd8", "JPEG"), (b"GIF8", "GIF"), (b"RIFF", "WebP")):
        if data.startswith(magic):
            return name
    return "encoded"
