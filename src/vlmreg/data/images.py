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
import re
import time
import urllib.error
import urllib.request
import warnings
from http.client import HTTPException
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from vlmreg.sdk.errors import VlmregError

if TYPE_CHECKING:
    from PIL import Image as PILImage

    from vlmreg.config.schema import DataSection

__all__ = ["ImageError", "ImageLimits", "ImageSource", "decode_image"]

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


@attrs.frozen(kw_only=True)
class ImageLimits:
    """What `decode_image` accepts. ``base_dir`` anchors relative paths (the dataset file's folder)."""

    max_bytes: int = attrs.field(default=20_000_000, validator=attrs.validators.gt(0))
    max_pixels: int = attrs.field(default=40_000_000, validator=attrs.validators.gt(0))
    allow_http: bool = False
    http_timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    base_dir: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))

    @classmethod
    def from_section(cls, section: DataSection, base_dir: str | Path | None = None) -> ImageLimits:
        """The limits a ``[data]`` section sets, with relative image paths resolved against ``base_dir``."""
        return cls(
            max_bytes=section.max_image_bytes,
            max_pixels=section.max_image_pixels,
            allow_http=section.allow_http,
            http_timeout_s=section.http_timeout_s,
            base_dir=base_dir,
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


def _read_file(text: str, limits: ImageLimits, where: str) -> bytes:
    path = Path(text).expanduser()
    if not path.is_absolute() and limits.base_dir is not None:
        path = limits.base_dir / path
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


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects only to ``http(s)://``: a server may not send us to ``file://`` or ``ftp://``."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        scheme = newurl.split(":", 1)[0].lower()
        if scheme not in ("http", "https"):
            raise urllib.error.URLError(f"redirect to {newurl} refused (only http(s) is fetched)")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _opener() -> urllib.request.OpenerDirector:
    """An opener that speaks only HTTP(S): no file://, ftp:// or data: handlers, unlike urlopen's."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(),
        _HttpOnlyRedirects(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


def _fetch_url(url: str, scheme: str, limits: ImageLimits, where: str) -> bytes:
    """GET ``url`` within ``http_timeout_s`` (per socket wait and in total) and ``max_bytes``, checked as it streams."""
    shown = url if len(url) <= 200 else url[:200] + "..."
    if scheme not in ("http", "https"):
        raise ImageError(where, f"{scheme}:// URLs are not allowed ({shown}); use a local path, a data: URI or http(s)://")
    if not limits.allow_http:
        raise ImageError(where, f"fetching images over HTTP is off ({shown}); set allow_http = true in [data] to allow it")
    timeout = limits.http_timeout_s
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"User-Agent": "vlmreg", "Accept": "image/*"})
    try:
        with _opener().open(request, timeout=timeout) as response:
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
    except ImageError:
        raise
    except urllib.error.HTTPError as exc:
        raise ImageError(where, f"HTTP {exc.code} {exc.reason} from {shown}") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise ImageError(where, f"timed out after {timeout:g} s fetching {shown}") from None
        raise ImageError(where, f"cannot fetch {shown}: {exc.reason}") from None
    except TimeoutError:
        raise ImageError(where, f"timed out after {timeout:g} s fetching {shown}") from None
    except (HTTPException, OSError, ValueError) as exc:
        raise ImageError(where, f"cannot fetch {shown}: {exc or type(exc).__name__}") from None
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
    except Image.DecompressionBombError as exc:
        raise ImageError(where, f"refused as a decompression bomb: {exc}") from None
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
