"""decode_image: every source kind, every limit, and every bad input, each message naming where and why."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image, PngImagePlugin

from tests.data.samples import bomb_png, data_uri, jpeg_bytes, noisy_png, png_bytes
from vlmreg.config.checks import SectionInvalid
from vlmreg.config.schema import DataSection
from vlmreg.data.images import ImageError, ImageLimits, decode_image
from vlmreg.sdk.errors import VlmregError

WHERE = "data/train.jsonl:12 messages[0].content[1].image_url"
LIMITS = ImageLimits()


def refused(source, limits: ImageLimits = LIMITS) -> str:
    """The message decode_image refuses ``source`` with; it must be one line starting with WHERE."""
    with pytest.raises(ImageError) as info:
        decode_image(source, limits=limits, where=WHERE)
    message = str(info.value)
    assert message.startswith(WHERE + ": ") and "\n" not in message
    assert isinstance(info.value, VlmregError) and info.value.where == WHERE
    return message[len(WHERE) + 2 :]


# -- sources ---------------------------------------------------------------------------------------------
def test_bytes_base64_and_data_uri_decode_to_the_same_rgb_image():
    png = png_bytes((8, 6), (255, 0, 0))
    for source in (png, bytearray(png), base64.b64encode(png).decode(), data_uri(png)):
        image = decode_image(source, limits=LIMITS, where=WHERE)
        assert image.mode == "RGB" and image.size == (8, 6) and image.getpixel((3, 3)) == (255, 0, 0)


def test_relative_paths_resolve_against_base_dir_and_absolute_paths_as_given(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(png_bytes((5, 4), (0, 255, 0)))
    image = decode_image("images/a.png", limits=ImageLimits(base_dir=tmp_path), where=WHERE)
    assert image.size == (5, 4) and image.getpixel((0, 0)) == (0, 255, 0)
    image = decode_image(str(tmp_path / "images" / "a.png"), limits=ImageLimits(base_dir="/nowhere"), where=WHERE)
    assert image.size == (5, 4)


def test_rgba_and_jpeg_become_rgb_and_exif_rotation_is_applied():
    rgba = decode_image(png_bytes((4, 4), (10, 20, 30, 128), mode="RGBA"), limits=LIMITS, where=WHERE)
    assert rgba.mode == "RGB"
    assert decode_image(jpeg_bytes((16, 8)), limits=LIMITS, where=WHERE).size == (16, 8)
    assert decode_image(jpeg_bytes((16, 8), orientation=6), limits=LIMITS, where=WHERE).size == (8, 16)


def test_an_animated_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (6, 4), c) for c in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    image = decode_image(buffer.getvalue(), limits=LIMITS, where=WHERE)
    assert image.mode == "RGB" and image.size == (6, 4) and image.getpixel((0, 0)) == (255, 0, 0)


def test_limits_come_from_the_data_section(tmp_path):
    section = DataSection(
        paths=["a.jsonl"], allow_http=True, http_timeout_s=2.5, max_image_bytes=10, max_image_pixels=20
    )
    limits = ImageLimits.from_section(section, base_dir=tmp_path)
    assert limits == ImageLimits(max_bytes=10, max_pixels=20, allow_http=True, http_timeout_s=2.5, base_dir=tmp_path)
    with pytest.raises(SectionInvalid) as info:
        DataSection(paths=["a.jsonl"], http_timeout_s=0.0)
    assert [str(p) for p in info.value.exceptions] == ["http_timeout_s: must be > 0 (got 0.0)"]


# -- bad input ---------------------------------------------------------------------------------------------
def test_corrupt_base64_is_refused():
    assert refused("data:image/png;base64,iVBORw0KGgo!!!notbase64").startswith("not valid base64")
    assert refused("iVBORw0KGgo@@@@").startswith("not valid base64")
    assert refused("data:image/png;base64," + base64.b64encode(b"garbage bytes").decode()).startswith("not an image")


def test_malformed_data_uris_are_refused():
    assert refused("data:text/plain;base64,aGVsbG8=") == "data: URI has media type 'text/plain', not an image type"
    assert refused("data:image/png,rawbytes") == "data: URI is not base64-encoded (expected ;base64,)"
    assert refused("data:image/png;base64").startswith("malformed data: URI")


def test_truncated_png_is_refused_by_a_full_decode():
    png = noisy_png()
    assert refused(png[: len(png) // 2]) == "corrupt or truncated PNG image: image file is truncated"


def test_decompression_bomb_is_refused_from_the_header_before_any_pixel_is_decoded(monkeypatch):
    decoded: list[object] = []
    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", lambda self: decoded.append(self))
    bomb = bomb_png(10_000, 10_000)  # 100 Mpx: under Pillow's own error threshold, over ours
    assert len(bomb) < 100
    assert refused(bomb) == "image is 10000x10000 = 100000000 pixels, more than max_image_pixels (40000000)"
    assert decoded == []
    # Pillow's own limit still applies on top of ours (10^10 pixels is refused while the header is read).
    assert refused(bomb_png(100_000, 100_000)).startswith(  # naming the key to raise, and Pillow's reason
        "refused as a decompression bomb, more than max_image_pixels (40000000): Image size (10000000000 pixels)"
    )
    assert decoded == []


def test_pixel_limit_applies_to_a_real_image():
    assert refused(png_bytes((100, 50)), ImageLimits(max_pixels=4999)) == (
        "image is 100x50 = 5000 pixels, more than max_image_pixels (4999)"
    )
    assert decode_image(png_bytes((100, 50)), limits=ImageLimits(max_pixels=5000), where=WHERE).size == (100, 50)


def test_byte_limit_applies_to_bytes_files_and_base64_before_decoding(tmp_path):
    png = png_bytes((8, 6))
    small = ImageLimits(max_bytes=len(png) - 1, base_dir=tmp_path)
    expected = f"image is {len(png)} bytes, more than max_image_bytes ({len(png) - 1})"
    assert refused(png, small) == expected
    (tmp_path / "a.png").write_bytes(png)
    assert refused("a.png", small) == expected
    huge = "iVBORw0KGgo" + "A" * 10_001  # refused from its length; never decoded
    assert refused(huge, ImageLimits(max_bytes=1000)) == "image is 7509 bytes, more than max_image_bytes (1000)"


def test_missing_file_directory_and_non_image_file(tmp_path):
    limits = ImageLimits(base_dir=tmp_path)
    assert refused("images/missing.png", limits) == f"image file not found: {tmp_path / 'images' / 'missing.png'}"
    assert refused(".", limits) == f"image path {tmp_path} is a folder, not an image file"
    (tmp_path / "notes.png").write_text("this is text, not a PNG\n")
    assert refused("notes.png", limits) == "not an image (or not one of PNG, JPEG, GIF, WEBP, BMP, TIFF)"
    assert refused(b"") == "empty image data"
    assert refused("a\0b.png", limits) == f"cannot read image file {tmp_path / 'a'}\0b.png: embedded null byte"
    text = base64.b64encode(bytes(range(60))).decode()  # base64-looking, but of no image format: read as a path
    assert (
        refused(text, limits)
        == f"image file not found: {tmp_path / text} (nor base64 of a PNG, JPEG, GIF, WebP, BMP or TIFF image)"
    )


def test_eps_is_not_opened_even_though_pillow_knows_it():
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"
    assert refused(eps).startswith("not an image")


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "s3://bucket/a.png"])
def test_other_url_schemes_are_refused(url):
    scheme = url.split(":")[0]
    message = refused(url, ImageLimits(allow_http=True))
    assert message == f"{scheme}:// URLs are not allowed ({url}); use a local path, a data: URI or http(s)://"


def test_urls_are_refused_while_fetching_is_off():
    assert refused("https://example.com/cat.png") == (
        "fetching images over HTTP is off (https://example.com/cat.png); set allow_http = true in [data] to allow it"
    )


def test_a_source_of_another_type_is_refused():
    assert refused(12) == "expected image bytes or a string, got int"


# -- HTTP against a real server ------------------------------------------------------------------------------
PNG = png_bytes((7, 3), (1, 2, 3))


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/ok.png":
            self._head(200, len(PNG))
            self.wfile.write(PNG)
        elif self.path == "/declared-huge.png":
            self._head(200, 10**9)
        elif self.path == "/endless.png":  # no Content-Length: only reading can tell the size
            self._head(200, None)
            self.wfile.write(PNG[:16])
            try:
                for _ in range(4096):
                    self.wfile.write(b"\0" * 65536)
            except OSError:
                pass
        elif self.path == "/slow.png":
            time.sleep(2)
            self._head(200, len(PNG))
            self.wfile.write(PNG)
        elif self.path in ("/to-file.png", "/to-ftp.png"):
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd" if "file" in self.path else "ftp://example.com/a.png")
            self.end_headers()
        else:
            self.send_error(404)

    def _head(self, status: int, length: int | None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """The client hangs up on purpose (limits, timeouts): a broken pipe here is expected."""


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = _QuietServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


HTTP = ImageLimits(allow_http=True, http_timeout_s=5.0)


def test_http_fetch_succeeds(server):
    image = decode_image(f"{server}/ok.png", limits=HTTP, where=WHERE)
    assert image.size == (7, 3) and image.getpixel((0, 0)) == (1, 2, 3)


def test_http_declared_size_over_the_limit_is_refused_before_the_body(server):
    assert (
        refused(f"{server}/declared-huge.png", HTTP)
        == "image is 1000000000 bytes, more than max_image_bytes (20000000)"
    )


def test_http_byte_limit_is_enforced_while_streaming(server):
    started = time.monotonic()
    limits = ImageLimits(allow_http=True, http_timeout_s=5.0, max_bytes=200_000)
    assert (
        refused(f"{server}/endless.png", limits)
        == "image is more than 200000 bytes, more than max_image_bytes (200000)"
    )
    assert time.monotonic() - started < 2  # stopped after ~200 kB, not after the server's 256 MB


def test_http_timeout(server):
    started = time.monotonic()
    limits = ImageLimits(allow_http=True, http_timeout_s=0.3)
    assert refused(f"{server}/slow.png", limits) == f"timed out after 0.3 s fetching {server}/slow.png"
    assert time.monotonic() - started < 1.5


def test_http_error_status_and_redirects_off_http_are_refused(server):
    assert refused(f"{server}/missing.png", HTTP) == f"HTTP 404 Not Found from {server}/missing.png"
    assert refused(f"{server}/to-file.png", HTTP) == (  # refused by our check, before urllib's own
        f"cannot fetch {server}/to-file.png: redirect to file:///etc/passwd refused (only http(s) is fetched)"
    )
    assert refused(f"{server}/to-ftp.png", HTTP) == (
        f"cannot fetch {server}/to-ftp.png: redirect to ftp://example.com/a.png refused (only http(s) is fetched)"
    )
