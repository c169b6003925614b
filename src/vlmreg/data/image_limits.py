"""What an image may be before it is decoded (`ImageLimits`), and the error that names an image refused (`ImageError`).

Shared by the decoder (`vlmreg.data.images`) and the HTTP fetcher (`vlmreg.data.fetch`), which both check sizes
against the same limits; neither imports the other at module level.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from vlmreg.sdk.errors import VlmregError

if TYPE_CHECKING:
    from vlmreg.config.schema import DataSection

__all__ = ["ImageError", "ImageLimits", "ImagePathError", "check_encoded_size"]


class ImageError(VlmregError, ValueError):
    """An image that cannot or may not be decoded; the one-line message names where it came from and why."""

    def __init__(self, where: str, reason: str) -> None:
        self.where, self.reason = where, " ".join(reason.split())
        super().__init__(f"{where}: {self.reason}" if where else self.reason)


class ImagePathError(ImageError):
    """A local image path (or ``file://`` URI) that resolves outside the allowed folders: refused, never opened."""


def _host_tuple(hosts: Iterable[str]) -> tuple[str, ...]:
    return tuple(hosts)


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
    redirect_hosts: tuple[str, ...] = attrs.field(default=(), converter=_host_tuple)
    #: what is read under these limits, and the key bounding its bytes, for messages (a video's limits say "video")
    kind: str = "image"
    bytes_key: str = "max_image_bytes"

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


def check_encoded_size(size: int, limits: ImageLimits, where: str, *, at_least: bool = False) -> None:
    if size > limits.max_bytes:
        amount = f"more than {limits.max_bytes}" if at_least else f"{size}"
        raise ImageError(where, f"{limits.kind} is {amount} bytes, more than {limits.bytes_key} ({limits.max_bytes})")
