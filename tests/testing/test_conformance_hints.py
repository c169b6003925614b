"""A failed conformance check gets the hint for what failed (issue 31 item 1: PaliGemma's sampler logprobs, 9.4e-3
against 1e-4, came with a hint to set turn_end_tokens, which was not the problem)."""

from __future__ import annotations

import pytest

from vlmreg.testing.conformance import STOP_HINTS, _assert_all
from vlmreg.testing.parity import Parity


def message(results: list[Parity]) -> str:
    with pytest.raises(AssertionError) as info:
        _assert_all(results, STOP_HINTS)
    return str(info.value)


def test_sampler_logprobs_failing_alone_does_not_point_at_turn_end_tokens():
    text = message(
        [
            Parity("stops at the turn end", True, "ok"),
            Parity("sampler logprobs", False, "max |sampler - plain forward| = 9.4e-03", 9.4e-3),
        ]
    )
    assert text.startswith("sampler logprobs: max |sampler - plain forward| = 9.4e-03")
    assert "turn_end_tokens" not in text and "bidirectional prefix" in text


def test_a_wrong_turn_end_points_at_turn_end_tokens_only():
    text = message([Parity("stops at the turn end", False, "completions [[7, 7]] did not stop at '<eos>'")])
    assert "turn_end_tokens" in text and "bidirectional prefix" not in text


def test_every_passing_check_passes():
    _assert_all([Parity("stops at the turn end", True, "ok"), Parity("sampler logprobs", True, "ok", 0.0)], STOP_HINTS)
