"""Small real image files for the data tests: PNGs, a JPEG, a truncated PNG and decompression bombs."""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib

from PIL import Image


def png_bytes(size: tuple[int, int] = (8, 6), colour: tuple[int, ...] = (255, 0, 0), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, colour).save(buffer, "PNG")
    return buffer.getvalue()


def noisy_png(size: tuple[int, int] = (64, 64)) -> bytes:
    """A PNG whose pixel data does not compress away, so cutting the file cuts pixels."""
    image = Image.frombytes("RGB", size, random.Random(0).randbytes(size[0] * size[1] * 3))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def jpeg_bytes(size: tuple[int, int] = (16, 8), orientation: int | None = None) -> bytes:
    image = Image.new("RGB", size, (0, 0, 255))
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", exif=exif)
    return buffer.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb_png(width: int, height: int) -> bytes:
    """A ~60-byte PNG whose IHDR (with a correct CRC) claims ``width x height`` RGB pixels."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b"")) + _chunk(b"IEND", b"")
