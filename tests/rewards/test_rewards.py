"""Reward functions against hand-computed values, their registry, `combine`, and garbage model output."""

from __future__ import annotations

import importlib
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmreg.rewards import (
    UnknownRewardError,
    boxed_contents,
    combine,
    committed_choice,
    get_reward,
    last_boxed,
    reward_names,
)
from vlmreg.rewards.math_answer import MAX_ANSWER_CHARS, same_math
from vlmreg.rollout.episodes import strip_reasoning

CHOICES = {"answer": "B", "choices": ["A", "B", "C", "D"]}


def test_the_registry_names_every_reward_function():
    assert reward_names() == ["exact_match", "first_word", "format", "math", "multiple_choice"]
    assert all(callable(get_reward(name)) for name in reward_names())


def test_an_unknown_reward_gets_a_suggestion_and_the_list():
    with pytest.raises(
        UnknownRewardError,
        match=r"unknown reward 'exact_mach'\. Did you mean 'exact_match'\? Rewards: exact_match, first_word",
    ):
        get_reward("exact_mach")
    with pytest.raises(LookupError):
        get_reward("nope")


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("Red", "red", 1.0),
        ("  RED! ", "red", 1.0),
        ("red.", "Red", 1.0),
        ("Red, I think", "red", 0.0),
        ("", "red", 0.0),
        ("3.5", 3.5, 1.0),
        ("35", 3.5, 0.0),
        ("<think>maybe blue</think> Green", "green", 0.0),  # rewards see the answer; the runner strips reasoning
        ("new  york", {"answer": "New York"}, 1.0),
        ("anything", None, 0.0),
    ],
)
def test_exact_match(completion, answer, expected):
    assert get_reward("exact_match")(completion, answer) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("Red", "Red", 1.0),
        ("red, I think", "Red", 1.0),
        ("Red.", "red", 1.0),
        ("Redd", "Red", 0.0),
        ("I think red", "Red", 0.0),
        ("\nBlue\n", "Blue", 1.0),
        ("New York is big", "new york", 1.0),
        ("", "Red", 0.0),
    ],
)
def test_first_word(completion, answer, expected):
    assert get_reward("first_word")(completion, answer) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("B", CHOICES, 1.0),
        ("The answer is (B).", CHOICES, 1.0),
        ("A seems likely, but the answer is B", CHOICES, 1.0),  # the commitment follows "answer is"
        ("I'd say \\boxed{B}", CHOICES, 1.0),
        ("A or B", CHOICES, 0.0),  # hedging names two choices
        ("C", CHOICES, 0.0),
        ("a bit of everything", CHOICES, 0.0),  # the article 'a' is not choice 'A'
        ("nothing", CHOICES, 0.0),
        ("dark green", {"answer": "dark green", "choices": ["green", "dark green"]}, 1.0),
        ("green", {"answer": "dark green", "choices": ["green", "dark green"]}, 0.0),
        ("It is red.", "red", 1.0),  # no choices: only the answer is looked for
        ("It is blue.", "red", 0.0),
    ],
)
def test_multiple_choice(completion, answer, expected):
    assert get_reward("multiple_choice")(completion, answer) == expected


def test_committed_choice_is_none_when_several_are_named():
    assert committed_choice("Red and Green", ["Red", "Green", "Blue"]) is None
    assert committed_choice("answer: Green", ["Red", "Green", "Blue"]) == "Green"


@pytest.mark.parametrize(
    ("text", "contents"),
    [
        ("\\boxed{3}", ["3"]),
        ("\\boxed{\\frac{1}{2}}", ["\\frac{1}{2}"]),
        ("a \\boxed{1} b \\boxed{2}", ["1", "2"]),
        ("\\boxed{\\boxed{3}}", ["\\boxed{3}"]),
        ("\\boxed {x^{2}}", ["x^{2}"]),
        ("\\boxed{\\{1,2\\}}", ["\\{1,2\\}"]),
        ("\\boxed{1} \\boxed{2", ["1"]),
        ("\\boxed3 and \\boxed{4}", ["4"]),
        ("no box", []),
    ],
)
def test_boxed_contents_keep_nested_braces(text, contents):
    assert boxed_contents(text) == contents


def test_last_boxed():
    assert last_boxed("first \\boxed{ 1 } then \\boxed{ 2 }") == "2"
    assert last_boxed("none") is None


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("\\boxed{\\frac{1}{2}}", 0.5, 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("So it is \\boxed{3}.", 3, 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("\\boxed{\\frac{6}{2}}", 3, 1.0),
        ("\\boxed{1+x}", "x+1", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
        ("\\boxed{3} no wait \\boxed{4}", 4, 1.0),  # the last box counts
        ("\\boxed{4} no wait \\boxed{3}", 4, 0.0),
        ("the answer is 3", 3, 0.0),  # no box
        ("\\boxed{}", 3, 0.0),
        ("\\boxed{3", 3, 0.0),  # never closed
        ("\\boxed{six}", 6, 0.0),
        ("<think>\\boxed{2}</think>\\boxed{3}", 3, 1.0),
        ("\\boxed{" + "9" * 600 + "}", 9, 0.0),  # too long to parse
        ("\\boxed{3}", {"answer": 3}, 1.0),
    ],
)
def test_math(completion, answer, expected):
    assert get_reward("math")(completion, answer) == expected


def test_math_works_off_the_main_thread():
    """Math-Verify's timeouts use SIGALRM, which only the main thread may set: elsewhere they are off."""
    results = []
    thread = threading.Thread(target=lambda: results.append(get_reward("math")("\\boxed{\\frac{1}{2}}", 0.5)))
    thread.start()
    thread.join()
    assert results == [1.0]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("The answer is \\boxed{3}.", 1.0),
        ("\\boxed{\\frac{1}{2}}", 1.0),
        ("\\boxed{3} or \\boxed{4}", 0.0),
        ("\\boxed{\\boxed{3}}", 0.0),
        ("\\boxed{ }", 0.0),
        ("\\boxed{3", 0.0),
        ("\\boxed{3} and \\boxed{", 0.0),
        ("3", 0.0),
        ("<think>\\boxed{1}</think> \\boxed{2}", 0.0),  # two boxes: the runner strips reasoning before rewards
    ],
)
def test_format(completion, expected):
    assert get_reward("format")(completion, "ignored") == expected


def test_combine_is_the_weighted_sum_and_reports_each_score():
    reward = combine({"math": 1.0, "format": 0.1})
    assert reward("\\boxed{3}", 3) == pytest.approx(1.1)
    assert reward("\\boxed{3} \\boxed{3}", 3) == pytest.approx(1.0)
    assert reward("\\boxed{2}", 3) == pytest.approx(0.1)
    assert reward("3", 3) == 0.0
    assert reward.scores("\\boxed{2}", 3) == {"math": 0.0, "format": 1.0}
    assert combine({"first_word": 2, "exact_match": -0.5})("Red car", "red") == pytest.approx(2.0)


def test_combine_checks_names_and_weights_when_built():
    with pytest.raises(UnknownRewardError, match=r"unknown reward 'maths'\. Did you mean 'math'\?") as info:
        combine({"maths": 1.0, "format": 0.1, "exact": 1.0})
    assert "'exact'. Did you mean 'exact_match'?" in str(info.value)
    with pytest.raises(ValueError, match="at least one"):
        combine({})
    with pytest.raises(TypeError, match="weight must be a number"):
        combine({"math": "1"})


GARBAGE = st.one_of(
    st.text(max_size=300),
    st.text(alphabet="\\{}boxed^_$()[]0123456789+-*/ fracsqrt</think>", max_size=200),
)


@settings(max_examples=150, deadline=None)
@given(completion=GARBAGE)
def test_no_reward_raises_on_garbage(completion):
    reward = combine({name: 1.0 for name in reward_names()})
    for answer in ("3", 3, 0.5, "\\frac{1}{2}", {"answer": "B", "choices": ["A", "B"]}, None, ""):
        assert 0.0 <= reward(completion, answer) <= len(reward_names())


@pytest.mark.parametrize("name", ["exact_match", "first_word", "format", "math", "multiple_choice"])
def test_a_completion_that_is_not_text_scores_zero(name):
    assert get_reward(name)(None, "3") == 0.0  # type: ignore[arg-type]


def test_rewards_score_the_answer_after_the_familys_thinking_end():
    """The episode runner hands environments the text after the family's marker (qwen's is ``</think>``)."""

    assert strip_reasoning("<think>maybe blue</think> Green", "</think>") == " Green"
    assert get_reward("exact_match")(strip_reasoning("<think>maybe blue</think> Green", "</think>"), "green") == 1.0
    assert get_reward("format")(strip_reasoning("<think>\\boxed{1}</think> \\boxed{2}", "</think>"), None) == 1.0
    # a family without a marker
    assert strip_reasoning("no reasoning </think> here", None) == "no reasoning </think> here"


def test_a_single_letter_choice_matches_only_in_its_case_longer_ones_in_any():
    assert committed_choice("The answer is B", ["A", "B"]) == "B"
    assert committed_choice("the answer is b", ["A", "B"]) is None  # "b" is a word, not the choice B
    assert committed_choice("I'd say a", ["A", "B"]) is None
    assert committed_choice("the answer is OK", ["ok", "no"]) == "ok"
    assert committed_choice("the answer is Dark Green", ["dark green", "red"]) == "dark green"


def test_a_boxed_command_with_spaces_and_no_brace_at_the_end_of_the_text_boxes_nothing():
    assert boxed_contents("the answer is \\boxed ") == [] and last_boxed("the answer is \\boxed   ") is None
    assert last_boxed("x \\boxed  {4}") == "4"


def test_answers_longer_than_the_limit_are_not_parsed_even_when_equal():
    long = "+".join(["1"] * (MAX_ANSWER_CHARS // 2 + 1))  # over the limit, and a valid sum
    assert len(long) > MAX_ANSWER_CHARS
    assert same_math("2", "1+1") and not same_math(long, long)
    at_limit = "+".join(["1"] * 255) + "+10"  # exactly the limit: still parsed, and its value is 265
    assert len(at_limit) == MAX_ANSWER_CHARS and same_math(at_limit, "265")


def test_combine_without_rewards_says_what_it_needs():
    with pytest.raises(ValueError) as caught:
        combine({})
    assert str(caught.value) == "combine() needs at least one reward name and weight"


def test_a_boxed_choice_overrides_choices_named_before_it():
    assert committed_choice(r"A looks right at first, but \boxed{B}", ["A", "B"]) == "B"


def test_an_answer_that_parses_to_nothing_or_fails_to_compare_is_wrong(monkeypatch):
    """same_math is False when the reference gives Math-Verify nothing to compare, and when comparing raises (sympy
    on model output can fail in many ways): a failure is never a right answer."""
    module = importlib.import_module("vlmreg.rewards.math_answer")  # the package re-exports a function of its name
    assert same_math("2", "2")
    monkeypatch.setattr(module, "_parse_reference", lambda reference: [])
    assert not same_math("2", "2")
    monkeypatch.undo()

    def broken(latex):
        raise RuntimeError("sympy gave up")

    monkeypatch.setattr(module, "_parse", broken)
    assert not same_math("2", "2")


def test_a_multiple_choice_question_without_a_correct_choice_scores_nothing():
    assert get_reward("multiple_choice")("The answer is A", {"answer": "", "choices": ["A", "B"]}) == 0.0
    assert get_reward("multiple_choice")("The answer is A", "  ") == 0.0
