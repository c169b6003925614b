"""`vlmreg serve`'s API key: where it comes from (a file, or ``VLMREG_API_KEY``) and how a request proves it.

The key is never taken on the command line, where ``ps`` shows it to every user of the host. A key file must be
readable by its owner only (mode 0600 or 0400), as ssh demands of private keys. A request carries the key as
``Authorization: Bearer KEY``; it is compared in constant time (`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
import stat
from collections.abc import Mapping
from pathlib import Path

from vlmreg.sdk.errors import VlmregError

__all__ = ["API_KEY_ENV", "bearer_matches", "check_key", "is_loopback", "read_api_key_file", "resolve_api_key"]

API_KEY_ENV = "VLMREG_API_KEY"


def check_key(key: str, where: str) -> str:
    """``key`` without surrounding whitespace; refused when empty or not printable ASCII (it travels in a header)."""
    key = key.strip()
    if not key:
        raise VlmregError(f"{where}: the API key is empty")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise VlmregError(f"{where}: the API key must be printable ASCII without spaces (it is sent in an HTTP header)")
    return key


def read_api_key_file(path: str | Path) -> str:
    """The key held in ``path``; refused (naming the file) when it is missing, unreadable, or open to group or
    others."""
    path = Path(path)
    where = f"--api-key-file {path}"
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise VlmregError(f"{where}: no such file") from None
    except OSError as exc:
        raise VlmregError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise VlmregError(f"{where}: not a regular file")
    if os.name == "posix" and mode & 0o077:
        raise VlmregError(
            f"{where}: the key file is accessible to group or others (mode {stat.S_IMODE(mode):04o}); "
            f"make it private with: chmod 600 {path}"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise VlmregError(f"{where}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    return check_key(text, where)


def resolve_api_key(key_file: str | Path | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The server's key: from ``key_file`` if given, else ``VLMREG_API_KEY`` if set; ``None`` when neither is."""
    if key_file is not None:
        return read_api_key_file(key_file)
    value = (os.environ if environ is None else environ).get(API_KEY_ENV)
    if value is None:
        return None
    return check_key(value, f"the environment variable {API_KEY_ENV}")


def bearer_matches(authorization: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer KEY`` for ``key`` (constant-time comparison)."""
    if not authorization:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    # headers arrive decoded as latin-1; compare bytes, so a non-ASCII header is a mismatch, not a TypeError
    return hmac.compare_digest(token.strip().encode("latin-1", "replace"), key.encode("ascii"))


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` is reachable from this machine only: a loopback address, or a name all of whose
    addresses are loopback (``localhost``). ``""``, ``0.0.0.0``, ``::``, a LAN address or an unresolvable name: no."""
    host = host.strip().strip("[]")
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    try:
        return bool(addresses) and all(ipaddress.ip_address(str(a).split("%", 1)[0]).is_loopback for a in addresses)
    except ValueError:
        return False
