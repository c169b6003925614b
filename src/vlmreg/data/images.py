"""Safe image decoding: bytes, base64, ``data:`` URIs, local files and (when allowed) ``http(s)://`` URLs
(fetched by `vlmreg.data.fetch`).

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
import os
import re
import stat
import urllib.parse
import urllib.request
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from vlmreg.data.image_limits import ImageError, ImageLimits, ImagePathError, check_encoded_size

if TYPE_CHECKING:
    from PIL import Image as PILImage

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


def decode_image(source: ImageSource, *, limits: ImageLimits, where: str) -> PILImage.Image:
    """Decode one image to an RGB PIL image, fully loaded, or raise `ImageError` naming ``where``.

    A string is read as a ``data:`` URI when it starts with ``data:``; as a URL when it has a scheme
    (``http``/``https`` only, and only with ``limits.allow_http``); as base64 text when it starts the way
    base64 of a PNG/JPEG/GIF/WebP/BMP/TIFF does or is longer than any path; otherwise as a file path.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        check_encoded_size(memoryview(source).nbytes, limits, where)
        data = bytes(source)
    elif isinstance(source, str):
        data = _read_string(source, limits, where)
    else:
        raise ImageError(where, f"expected image bytes or a string, got {type(source).__name__}")
    return _decode_bytes(data, limits, where)


# -- getting the encoded bytes ----------------------------------------------------------------------
def _read_string(text: str, limits: ImageLimits, where: str) -> bytes:
    if text.startswith("data:"):
        return _read_data_uri(text, limits, where)
    scheme = _URL_SCHEME.match(text)
    if scheme and scheme.group(1).lower() == "file" and limits.roots is not None:
        return _read_file(_file_uri_path(text, where), limits, where)  # confined: a file:// URI is a path
    if scheme:
        # deferred: here: urllib, sockets and threads only when a URL comes
        from vlmreg.data.fetch import fetch_url  # noqa: PLC0415

        return fetch_url(text, scheme.group(1).lower(), limits, where)
    stripped = text.strip()
    if len(stripped) > _LONGEST_PATH or (
        stripped.startswith(_BASE64_SIGNATURES) and "." not in stripped and not _is_file(text, limits)
    ):
        return _decode_base64(stripped, limits, where)
    return _read_file(text, limits, where)


def _is_file(text: str, limits: ImageLimits) -> bool:
    """Whether ``text`` names an existing file (relative to ``limits.base_dir``): then it is a path, whatever it looks
    like, as transformers' ``load_image`` decides (a file first, base64 after)."""
    path = os.path.expanduser(text)
    if not os.path.isabs(path) and limits.base_dir is not None:
        path = os.path.join(limits.base_dir, path)
    if not os.path.isfile(path):  # False for a missing path, a NUL byte or a name too long
        return False
    # Confined: only a file inside the allowed folders counts, so base64 text cannot probe the disk outside them.
    return limits.roots is None or _inside(Path(os.path.realpath(path)), limits.roots)


def _decode_base64(text: str, limits: ImageLimits, where: str) -> bytes:
    clean = "".join(text.split())
    # The decoded size follows from the text's length: check it before decoding any of it.
    check_encoded_size(len(clean) * 3 // 4 - clean[-2:].count("="), limits, where)
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
    return _decode_base64(text[match.end() :], limits, where)


def _file_uri_path(text: str, where: str) -> str:
    """The local path a ``file://`` URI names (``file:///abs/path`` or ``file://localhost/abs/path``)."""
    parts = urllib.parse.urlsplit(text)
    if parts.netloc not in ("", "localhost"):
        raise ImagePathError(
            where, f"file:// URI {text!r} names host {parts.netloc!r}; only local files (file:///path) are read"
        )
    return urllib.request.url2pathname(parts.path)


def _inside(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path.is_relative_to(root) for root in roots)


def _outside(text: str, real: Path, roots: tuple[Path, ...], where: str, limits: ImageLimits) -> ImagePathError:
    allowed = ", ".join(str(root) for root in roots) or "none"
    return ImagePathError(
        where,
        f"{limits.kind} path {text!r} resolves to {real}, outside the allowed image folders ({allowed}); "
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
            raise _outside(text, loose, roots, where, limits) from None
        hint = " (nor base64 of a PNG, JPEG, GIF, WebP, BMP or TIFF image)" if _BASE64_TEXT.fullmatch(text) else ""
        raise ImageError(where, f"{limits.kind} file not found: {path}{hint}") from None
    except RuntimeError:  # a symlink loop (Python 3.11)
        raise ImageError(where, f"cannot read {limits.kind} file {path}: symlink loop") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ImageError(
            where, f"cannot read {limits.kind} file {path!s}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    if not _inside(real, roots):
        raise _outside(text, real, roots, where, limits)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)  # the checked, symlink-free path; O_NONBLOCK: a FIFO swapped in cannot hang us
    except OSError as exc:
        raise ImageError(where, f"cannot read {limits.kind} file {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # before fdopen, which raises IsADirectoryError for a folder
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise ImageError(
                where,
                f"{limits.kind} path {path} is {kind}, not {'a video' if limits.kind == 'video' else 'an image'} file",
            )
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as handle:
        check_encoded_size(info.st_size, limits, where)
        try:
            data = handle.read(limits.max_bytes + 1)
        except OSError as exc:
            raise ImageError(where, f"cannot read {limits.kind} file {path}: {exc.strerror or exc}") from None
    check_encoded_size(len(data), limits, where, at_least=True)  # the file grew after fstat
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
        raise ImageError(where, f"{limits.kind} file not found: {path}{hint}") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ImageError(
            where, f"cannot read {limits.kind} file {path!s}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    if not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file"
        raise ImageError(
            where,
            f"{limits.kind} path {path} is {kind}, not {'a video' if limits.kind == 'video' else 'an image'} file",
        )
    check_encoded_size(size, limits, where)
    try:
        with path.open("rb") as handle:
            data = handle.read(limits.max_bytes + 1)
    except OSError as exc:
        raise ImageError(where, f"cannot read {limits.kind} file {path}: {exc.strerror or exc}") from None
    check_encoded_size(len(data), limits, where, at_least=True)  # the file grew after stat
    return data


# -- decoding ---------------------------------------------------------------------------------------
def _decode_bytes(data: bytes, limits: ImageLimits, where: str) -> PILImage.Image:
    # deferred: start-up cost (loads PIL)
    from PIL import Image, ImageOps, UnidentifiedImageError  # noqa: PLC0415

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
                f"image is {width}x{height} = {width * height} pixels, more than max_image_pixels "
                f"({limits.max_pixels})",
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
