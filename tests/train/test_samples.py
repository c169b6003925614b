"""Trajectories -> training samples: multi-turn merge, loss masks, image-safe truncation (no model needed)."""

from __future__ import annotations

import attrs
import pytest
import torch
from PIL import Image

from tests.train.test_packing import setup_family
from vlmreg.data import Example, image_part, text_part
from vlmreg.data.truncation import safe_cut
from vlmreg.modeling.logprobs import selected_logprobs
from vlmreg.rollout.episodes import Trajectory, Turn
from vlmreg.train.batching import make_microbatches
from vlmreg.train.samples import build_samples

IMG = 5  # the image token id of these hand-written sequences


def spans_of(prompt, counts):
    """Spans of the runs of IMG in ``prompt``, one run per image."""
    positions = [i for i, t in enumerate(prompt) if t == IMG]
    spans, at = [], 0
    for n in counts:
        spans.append((positions[at], positions[at] + n))
        at += n
    return spans


def turn(prompt, images, tokens, completion, reward=0.0):
    return Turn(
        list(prompt),
        list(images),
        spans_of(prompt, tokens),
        list(completion),
        [-0.5] * len(completion),
        "text",
        "stop",
        reward,
    )


def trajectory(*turns):
    t = Trajectory(Example("ep:0", [{"role": "user", "content": "x"}], answer="a"), group=0)
    t.turns.extend(turns)
    return t


def test_turns_whose_prompts_extend_each_other_merge_into_one_sample():
    t1 = turn([1, 3, IMG, IMG, 4, 10], ["a"], [2], [20, 2])
    t2 = turn([1, 3, IMG, IMG, 4, 10, 20, 2, 11, 3, IMG, IMG, IMG, 4, 12], ["a", "b"], [2, 3], [21, 2])
    samples, stats = build_samples([trajectory(t1, t2)], [1.5], seq_len=100)
    assert len(samples) == 1 and stats.merged_turns == 1 and stats.prefix_breaks == 0
    s = samples[0]
    assert s.input_ids == t2.prompt_ids + [21, 2]
    assert s.loss_mask == [False] * 6 + [True, True] + [False] * 7 + [True, True]
    assert s.rollout_logprobs == [0.0] * 6 + [-0.5, -0.5] + [0.0] * 7 + [-0.5, -0.5]
    assert s.image_ids == ["a", "b"] and s.image_tokens == [2, 3] and s.advantage == 1.5


def test_a_broken_prefix_starts_a_new_sample():
    t1 = turn([1, 10], [], [], [20, 2])
    t2 = turn([1, 10, 99, 2, 11], [], [], [21, 2])  # the completion re-tokenized differently
    samples, stats = build_samples([trajectory(t1, t2)], [1.0], seq_len=100)
    assert [s.input_ids for s in samples] == [[1, 10, 20, 2], [1, 10, 99, 2, 11, 21, 2]]
    assert stats.prefix_breaks == 1
    assert stats.break_reasons == [
        "ep:0 turn 2: the prompt does not extend the previous turn's tokens (token 2 differs); a new sample starts"
    ]


def test_overlong_samples_are_cut_before_an_image_never_inside_it():
    prompt = [1, 3, IMG, IMG, 4, 10, 3, IMG, IMG, IMG, 4, 11]
    t = turn(prompt, ["a", "b"], [2, 3], [20, 21, 22])
    samples, stats = build_samples([trajectory(t)], [1.0], seq_len=8)  # 8 falls in image b
    assert samples == [] and stats.dropped == 1  # the cut leaves no generated token: dropped, counted
    t = turn([1, 3, IMG, IMG, 4, 30, 31], ["a"], [2], [20, 21, 22, 23, 24])
    samples, stats = build_samples([trajectory(t)], [1.0], seq_len=10)
    assert samples[0].input_ids == [1, 3, IMG, IMG, 4, 30, 31, 20, 21, 22] and stats.truncated == 1


def test_an_image_split_by_seq_len_is_dropped_with_its_tokens():
    merged = [
        turn([1, 3, IMG, IMG, 4, 10], ["a"], [2], [20, 2]),
        turn([1, 3, IMG, IMG, 4, 10, 20, 2, 3, IMG, IMG, IMG, 4, 12], ["a", "b"], [2, 3], [21, 2]),
    ]
    samples, stats = build_samples([trajectory(*merged)], [1.0], seq_len=11)
    s = samples[0]
    assert s.input_ids == [1, 3, IMG, IMG, 4, 10, 20, 2, 3]  # cut before image b's tokens
    assert s.image_ids == ["a"] and s.image_tokens == [2] and s.image_spans == [(2, 4)] and stats.images_cut == 1


def test_drop_mode_drops_overlong_samples():
    t = turn([1, 30, 31, 32], [], [], [20, 21, 22, 23])
    samples, stats = build_samples([trajectory(t)], [1.0], seq_len=6, overlong="drop")
    assert samples == [] and stats.dropped == 1


def test_the_check_runs_on_every_sample_with_its_name():
    seen = []
    t = turn([1, IMG, IMG, 10], ["a"], [2], [20, 2])
    build_samples(
        [trajectory(t)], [1.0], seq_len=100, check=lambda ids, images, spans, where: seen.append((images, spans, where))
    )
    assert seen == [(["a"], [(1, 3)], "ep:0")]


def test_safe_cut_keeps_whole_images():
    spans = [(1, 3), (4, 6)]  # [1, IMG, IMG, 2, IMG, IMG, 3]
    assert safe_cut(7, spans, 100).images == 2
    cut = safe_cut(7, spans, 5)
    assert (cut.length, cut.images) == (4, 1)
    cut = safe_cut(7, spans, 6)
    assert (cut.length, cut.images) == (6, 2)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_truncation_keeps_tokens_and_pixels_together_with_each_family(family):
    """Two turns with a real processor, merged; the cut falls in the second turn's image: the first turn's image and
    completion stay, the second image goes with all its tokens, and the model runs the cut sample."""

    loaded, encoder, _ = setup_family(family)
    store = encoder.store
    first, second = store.add(Image.new("RGB", (64, 64), "red")), store.add(Image.new("RGB", (96, 96), "blue"))
    turn1 = [{"role": "user", "content": [image_part(first), text_part("What colour is the shape?")]}]
    prompt1 = encoder.encode(turn1)
    answer = encoder.tokenizer("Red", add_special_tokens=False)["input_ids"] + [encoder.stop_ids[0]]
    reply = [{"role": "user", "content": [image_part(second), text_part("And this one?")]}]
    prompt2 = encoder.extend(prompt1, answer, reply)
    # the prefix property
    assert prompt2.input_ids[: len(prompt1.input_ids) + len(answer)] == prompt1.input_ids + answer
    turns = [
        Turn(
            prompt1.input_ids, prompt1.image_ids, prompt1.image_spans, answer, [-1.0] * len(answer), "Red", "stop", 1.0
        ),
        Turn(
            prompt2.input_ids, prompt2.image_ids, prompt2.image_spans, answer, [-1.0] * len(answer), "Red", "stop", 1.0
        ),
    ]
    start, end = prompt2.image_spans[1]
    samples, stats = build_samples([trajectory(*turns)], [1.0], seq_len=start + 1, check=encoder.check)
    s = samples[0]
    assert stats.merged_turns == 1 and stats.truncated == 1 and stats.images_cut == 1
    assert s.image_ids == [first] and s.image_spans == prompt1.image_spans and len(s) == start
    assert sum(s.loss_mask) == len(answer)
    batch = make_microbatches(samples, loaded.resolved, encoder, budget=4096, packed=True, device=loaded.device)[0]
    with torch.no_grad():
        logp, _ = selected_logprobs(loaded.resolved, batch.inputs, batch.targets, batch.loss_mask)
    assert logp.numel() == len(answer) and torch.isfinite(logp).all()


def test_three_turns_that_extend_each_other_merge_into_one_sample():
    t1 = turn([1, 10], [], [], [20, 2])
    t2 = turn([1, 10, 20, 2, 11], [], [], [21, 2])
    t3 = turn([1, 10, 20, 2, 11, 21, 2, 12], [], [], [22, 23, 2])
    samples, stats = build_samples([trajectory(t1, t2, t3)], [1.0], seq_len=100)
    assert [s.input_ids for s in samples] == [[1, 10, 20, 2, 11, 21, 2, 12, 22, 23, 2]]
    assert samples[0].loss_mask == [False, False, True, True, False, True, True, False, True, True, True]
    assert stats.merged_turns == 2 and stats.prefix_breaks == 0


def test_every_truncated_sample_is_counted():
    long = [turn([1, 30, 31], [], [], [20, 21, 22, 23]), turn([1, 40, 41], [], [], [24, 25, 26, 27])]
    samples, stats = build_samples([trajectory(long[0]), trajectory(long[1])], [1.0, -1.0], seq_len=5)
    assert [s.input_ids for s in samples] == [[1, 30, 31, 20, 21], [1, 40, 41, 24, 25]]
    assert [s.advantage for s in samples] == [1.0, -1.0] and [s.trajectory for s in samples] == [0, 1]
    assert stats.truncated == 2 and stats.dropped == 0


def test_a_turn_that_dropped_images_under_the_budget_starts_a_new_sample_counted_apart_from_breaks():
    """The second prompt dropped image a (the image budget): it is trained in its own context, not merged, and the
    split is counted in budget_splits, not as a prefix break."""
    t1 = turn([1, 3, IMG, IMG, 4, 10], ["a"], [2], [20, 2])
    t2 = attrs.evolve(turn([1, 3, IMG, IMG, IMG, 4, 12], ["b"], [3], [21, 2]), budget_break=True)
    samples, stats = build_samples([trajectory(t1, t2)], [0.5], seq_len=100)
    assert [s.input_ids for s in samples] == [[1, 3, IMG, IMG, 4, 10, 20, 2], [1, 3, IMG, IMG, IMG, 4, 12, 21, 2]]
    assert [s.image_ids for s in samples] == [["a"], ["b"]] and samples[1].image_spans == [(2, 5)]
    assert stats.budget_splits == 1 and stats.prefix_breaks == 0 and stats.break_reasons == []
    # even a prompt that does extend the previous turn starts a new sample when the turn says so
    t3 = attrs.evolve(turn([1, 3, IMG, IMG, 4, 10, 20, 2, 11], ["a"], [2], [22, 2]), budget_break=True)
    samples, stats = build_samples([trajectory(t1, t3)], [0.5], seq_len=100)
    assert len(samples) == 2 and stats.budget_splits == 1 and stats.merged_turns == 0


def test_every_count_adds_up_over_several_trajectories():
    """Two of each event, in two trajectories: every counter counts each one (not just the last), by hand."""

    def events(example):
        first = turn([1, 3, IMG, IMG, 4, 10], ["a"], [2], [20, 2])
        broken = turn([1, 3, IMG, IMG, 4, 10, 99, 2, 11], ["a"], [2], [21, 2])  # token 6 differs: a prefix break
        budget = attrs.evolve(turn([1, 3, IMG, IMG, IMG, 4, 12], ["b"], [3], [22, 2]), budget_break=True)
        t = trajectory(first, broken, budget)
        t.example = Example(example, [{"role": "user", "content": "x"}], answer="a")
        return t

    samples, stats = build_samples([events("ep:0"), events("ep:1")], [1.0, -1.0], seq_len=100)
    assert stats.prefix_breaks == 2 and stats.budget_splits == 2 and stats.merged_turns == 0
    assert [s.example_id for s in samples] == ["ep:0"] * 3 + ["ep:1"] * 3
    # cut inside the second image of a merged sample, twice: both truncations and both cut images counted
    merged = [
        turn([1, 3, IMG, IMG, 4, 10], ["a"], [2], [20, 2]),
        turn([1, 3, IMG, IMG, 4, 10, 20, 2, 3, IMG, IMG, IMG, 4, 12], ["a", "b"], [2, 3], [21, 2]),
    ]
    samples, stats = build_samples([trajectory(*merged), trajectory(*merged)], [1.0, 1.0], seq_len=11)
    assert stats.truncated == 2 and stats.images_cut == 2 and stats.dropped == 0 and len(samples) == 2
    long = turn([1, 30, 31, 32], [], [], [20, 21, 22, 23])
    samples, stats = build_samples([trajectory(long), trajectory(long)], [1.0, 1.0], seq_len=6, overlong="drop")
    assert samples == [] and stats.dropped == 2


def test_a_sample_of_exactly_seq_len_is_neither_cut_nor_dropped():
    t = turn([1, 30, 31, 32], [], [], [20, 21, 22, 23])  # 8 tokens
    for overlong in ("truncate", "drop"):
        samples, stats = build_samples([trajectory(t)], [1.0], seq_len=8, overlong=overlong)
        assert [s.input_ids for s in samples] == [[1, 30, 31, 32, 20, 21, 22, 23]]
        assert stats.truncated == 0 and stats.dropped == 0 and stats.images_cut == 0


def test_positions_the_engine_wrote_stay_out_of_the_loss_in_first_and_merged_turns():
    t1 = attrs.evolve(turn([1, 10], [], [], [20, 21, 2]), forced=(1,))  # the engine wrote token 21
    t2 = attrs.evolve(turn([1, 10, 20, 21, 2, 11], [], [], [22, 23, 2]), forced=(0, 2))
    samples, stats = build_samples([trajectory(t1, t2)], [1.0], seq_len=100)
    assert stats.merged_turns == 1
    assert samples[0].input_ids == [1, 10, 20, 21, 2, 11, 22, 23, 2]
    assert samples[0].loss_mask == [False, False, True, False, True, False, False, True, False]


def test_a_break_names_where_a_shorter_prompt_ends_and_an_image_change_as_such():
    t1 = turn([1, 10], [], [], [20, 2])
    short = turn([1, 10, 20], [], [], [21, 2])  # a prefix of the previous tokens, one short: it differs at 3
    _, stats = build_samples([trajectory(t1, short)], [1.0], seq_len=100)
    assert stats.break_reasons == [
        "ep:0 turn 2: the prompt does not extend the previous turn's tokens (token 3 differs); a new sample starts"
    ]
    a = turn([1, 3, IMG, IMG, 4, 10], ["a"], [2], [20, 2])
    other_image = turn([1, 3, IMG, IMG, 4, 10, 20, 2, 11], ["z"], [2], [21, 2])  # same tokens, another image
    samples, stats = build_samples([trajectory(a, other_image)], [1.0], seq_len=100)
    assert len(samples) == 2 and stats.prefix_breaks == 1
    assert stats.break_reasons == [
        "ep:0 turn 2: the prompt does not extend the previous turn's tokens (the images differ); a new sample starts"
    ]
