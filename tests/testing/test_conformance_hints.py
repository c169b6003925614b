"""A failed conformance check gets the hint for what failed (issue 31 item 1: PaliGemma's sampler logprobs, 9.4e-3
against 1e-4, came with a hint to set turn_end_tokens, which was not the problem)."""

from __future__ import annotations

import pytest

from vlmreg.testing.conformance import STOP_HINTS, _assert_all
from vlmreg.testing.hints import CONTRACT_HINTS, contract_hint
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
    assert "processor contract requirement 9" in text and "fields prefix_lm" in text  # the requirement, its field


def test_a_wrong_turn_end_points_at_turn_end_tokens_only():
    text = message([Parity("stops at the turn end", False, "completions [[7, 7]] did not stop at '<eos>'")])
    assert "turn_end_tokens" in text and "bidirectional prefix" not in text


def test_every_passing_check_passes():
    _assert_all([Parity("stops at the turn end", True, "ok"), Parity("sampler logprobs", True, "ok", 0.0)], STOP_HINTS)


@pytest.mark.parametrize(
    ("check", "requirement", "field"),
    [
        ("prompt, 2 image(s)", "requirements 2, 5-7", "prefix_lm"),
        ("logprobs, padded", "requirement 9", "prefix_lm"),
        ("3-turn prompt", "requirement 8", "prefix_lm"),
        ("stops at the turn end", "requirement 3", "turn_end_tokens"),
    ],
)
def test_each_failed_check_names_its_requirement_and_the_field_that_lifts_it(check, requirement, field):
    """The conformance failure, and the hint `vlmreg check` prints, name the processor contract's requirement (as
    numbered in docs/reference.md) and the descriptor field."""
    text = message([Parity(check, False, "differs")])
    assert f"processor contract {requirement}" in text and field in text
    assert contract_hint(check) in text


def test_the_hints_number_the_requirements_as_the_reference_does():
    """Each numbered requirement a hint cites is one of docs/reference.md's, and each field it names is a descriptor
    field."""
    import re  # noqa: PLC0415 - beside the test that needs it
    from pathlib import Path  # noqa: PLC0415 - beside the test that needs it

    import attrs  # noqa: PLC0415 - beside the test that needs it

    from vlmreg.sdk.descriptor import FamilyDescriptor  # noqa: PLC0415 - beside the test that needs it

    reference = (Path(__file__).resolve().parents[2] / "docs" / "reference.md").read_text()
    contract = reference[reference.index("### The processor contract") : reference.index("## `LoraPreset`")]
    numbered = {int(n) for n in re.findall(r"^(\d+)\. \*\*", contract, re.M)}
    fields = {f.name for f in attrs.fields(FamilyDescriptor)}
    for _, hint in CONTRACT_HINTS:
        cited = re.search(r"requirements? ([\d, -]+)", hint).group(1)
        for part in re.findall(r"\d+(?:-\d+)?", cited):
            low, _, high = part.partition("-")
            assert set(range(int(low), int(high or low) + 1)) <= numbered, (part, hint)
        for name in re.findall(r"fields? ([a-z_, ]+?)(?:[;(:]|$)", hint):
            for field in re.split(r",\s*| ", name.strip()):
                if field:
                    assert field in fields, (field, hint)
