"""`TokenText`: token bytes for byte-level and byte-fallback tokenizers, stop checks and stream pieces, against
plain decoding with the tokenizer."""

from __future__ import annotations

import random

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models
from transformers.convert_slow_tokenizer import bytes_to_unicode

from vlmreg.serve.tokens import TokenText, cut_at_stop
from vlmreg.testing.parity import tiny_processor


@pytest.fixture(scope="module")
def byte_level():
    return tiny_processor("qwen3_vl").tokenizer


def byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer: ``▁`` pieces, ``<0xHH>`` byte tokens, and a decoder that strips the first
    space."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ("▁hi", "▁there", "hi"):
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend)


def test_byte_level_bytes_are_exact_and_decode_to_the_text(byte_level):
    text = TokenText(byte_level)
    assert text.byte_level and not text.byte_fallback
    table = {c: b for b, c in bytes_to_unicode().items()}
    special = {i for i, t in byte_level.added_tokens_decoder.items() if t.special}
    for token_id in range(len(byte_level)):
        expected = (
            byte_level.added_tokens_decoder[token_id].content.encode()
            if token_id in special
            else bytes(table[c] for c in byte_level.convert_ids_to_tokens(token_id))
        )
        assert text.bytes(token_id) == expected
    ids = byte_level("naïve café ☕ 日本", add_special_tokens=False)["input_ids"]
    assert b"".join(text.bytes(t) for t in ids).decode() == "naïve café ☕ 日本"
    assert any(text.token(t) == "\ufffd" for t in ids)  # decode alone loses what bytes keep


def test_byte_fallback_tokens_give_their_byte_and_other_pieces_their_decoded_text():
    tokenizer = byte_fallback_tokenizer()
    text = TokenText(tokenizer)
    assert text.byte_fallback and not text.byte_level
    assert [text.bytes(b) for b in (0x61, 0xC3, 0xA9)] == [b"a", b"\xc3", b"\xa9"]
    assert text.bytes(tokenizer.convert_tokens_to_ids("▁hi")) == b"hi"  # decoded alone: the decoder strips the space
    assert text.bytes(10_000) == b""  # past the vocabulary


def test_stop_checks_match_plain_decoding_token_by_token(byte_level):
    text = TokenText(byte_level)
    rng = random.Random(0)
    special = sorted(text.skipped)
    for _ in range(60):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(9, len(byte_level)) for _ in range(40)]
        decoded = text.text(ids)
        start = rng.randrange(max(1, len(decoded) - 3))
        stops = [decoded[start : start + rng.randint(1, 3)], "never there"]
        check = text.stop_check(stops)
        for m in range(1, len(ids) + 1):  # as in generation: asked after each token until it first holds
            found = any(s in text.text(ids[:m]) for s in stops)
            assert check(ids[:m]) == found, (ids[:m], stops)
            if found:
                break


def test_stream_pieces_concatenate_to_the_text_and_never_run_ahead(byte_level):
    text = TokenText(byte_level)
    rng = random.Random(1)
    for _ in range(60):
        ids = [rng.randrange(0, len(byte_level)) for _ in range(30)]
        full = text.text(ids)
        for content in (full, cut_at_stop(full, [full[5:7]] if len(full) > 7 else ["x"])[0]):
            pieces = text.pieces(ids, content)
            assert len(pieces) == len(ids) and "".join(pieces) == content
            for m in range(1, len(ids)):  # what was sent after m tokens is text those tokens already fixed
                sent = "".join(pieces[:m])
                assert text.text(ids[:m]).startswith(sent) and content.startswith(sent)


def test_cut_at_stop_takes_the_earliest_stop():
    assert cut_at_stop("one two three", ["three", "two"]) == ("one ", True)
    assert cut_at_stop("one", ["x"]) == ("one", False)
