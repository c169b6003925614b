"""Tokens as the OpenAI schema shows them: each token's text and exact bytes, stop strings, and stream pieces.

`TokenText` wraps the served tokenizer and is used on the worker thread only. A token's ``bytes`` are exact
for byte-level BPE tokenizers (the token's characters mapped back through GPT-2's byte table, so a token
holding half of a UTF-8 character gives that half, where ``decode`` would give U+FFFD) and for byte-fallback
tokens ``<0xHH>``; added tokens give their literal text; any other token gives the UTF-8 of ``decode([id])``.
"""

from __future__ import annotations

import builtins
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["TokenText", "byte_decoder", "cut_at_stop"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_decoder() -> dict[str, int]:
    """GPT-2's table from the printable character standing for each byte back to the byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = dict(zip(printable, printable, strict=True)), 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _decoder_types(tokenizer: Any) -> set[str]:
    """The types of the tokenizer's decoder steps (``ByteLevel``, ``ByteFallback``, ...); empty when unknown."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    try:
        state = json.loads(decoder.__getstate__())
    except Exception:  # a decoder that does not serialise: treat the tokenizer as not byte-level
        return set()
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(state)
    return found


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the earliest stop string it contains, and whether one was found."""
    at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:at], True) if at >= 0 else (text, False)


class TokenText:
    """Text and bytes of the served tokenizer's tokens (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        kinds = _decoder_types(tokenizer)
        self.byte_level = "ByteLevel" in kinds
        self.byte_fallback = "ByteFallback" in kinds
        self._byte_of = byte_decoder() if self.byte_level else {}
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        self.skipped = {int(i) for i, t in added.items() if getattr(t, "special", False)} | set(
            getattr(tokenizer, "all_special_ids", ())
        )
        self._bytes: dict[int, bytes] = {}
        self._tokens: dict[int, str] = {}

    def text(self, ids: Sequence[int]) -> str:
        """The completion's text, as the response carries it: special tokens left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token(self, token_id: int) -> str:
        """The token decoded alone (a partial UTF-8 character shows as U+FFFD; see `bytes` for the exact bytes)."""
        if token_id not in self._tokens:
            self._tokens[token_id] = self.tokenizer.decode([token_id])
        return self._tokens[token_id]

    def bytes(self, token_id: int) -> bytes:
        """The token's exact bytes (see the module's docstring for tokenizers that are not byte-level)."""
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._token_bytes(token_id)
        return found

    def _token_bytes(self, token_id: int) -> builtins.bytes:  # builtins: the method `bytes` above shadows the type
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:  # an id past the tokenizer's vocabulary (the model's may be larger): no text
            return b""
        if self.byte_level and all(c in self._byte_of for c in piece):
            return bytes(self._byte_of[c] for c in piece)
        if self.byte_fallback:
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        return self.token(token_id).encode()

    def stop_check(self, stops: Sequence[str]) -> Callable[[list[int]], bool]:
        """A test for `EmbeddedEngine.generate`'s ``stop_when``: does the completion's text contain a stop string?

        It is asked after every token until it first holds (a completion that contains a stop string has ended),
        so a new match ends in the last token: for byte-level tokenizers it first decodes only the tail that could
        hold one (the last tokens covering the longest stop string's bytes, plus a character's worth), and decodes
        the whole completion only to confirm.
        """
        stops = tuple(stops)
        need = max(len(s.encode()) for s in stops) + 4

        def check(ids: list[int]) -> bool:
            if self.byte_level:
                start, seen = len(ids), 0
                while start > 0 and seen < need:
                    start -= 1
                    seen += 0 if ids[start] in self.skipped else len(self.bytes(ids[start]))
                if start > 0:
                    tail = self.text(ids[start:])
                    if not any(s in tail for s in stops):
                        return False
            text = self.text(ids)
            return any(s in text for s in stops)

        return check

    def pieces(self, ids: Sequence[int], text: str) -> list[str]:
        """Per token, the piece of ``text`` (the returned, possibly stop-cut, content) a stream sends with it.

        The pieces concatenate to ``text``. A token that ends inside a UTF-8 character sends nothing; the
        character goes with the token that completes it. Tokens past a stop string send nothing.
        """
        out: list[str] = []
        emitted = 0
        for i in range(len(ids)):
            decoded = self.text(ids[: i + 1]).rstrip("\ufffd")
            upto = min(len(decoded), len(text))
            if upto > emitted and decoded[:upto] == text[:upto]:
                out.append(text[emitted:upto])
                emitted = upto
            else:
                out.append("")
        if out:
            out[-1] += text[emitted:]
        return out
