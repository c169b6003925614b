"""What each micro-batch position asks the loss for, checked against the tokenizer, not against vlmreg.

A completion is written as text and tokenized by the family's own tokenizer; the loss positions of every
micro-batch layout (packed, padded, split over several micro-batches) must target exactly those tokens, in order,
with the logprobs the rollout recorded for them and the sample's advantage. `tests/train/test_packing.py` checks that
the layouts agree with a plain forward; this checks which positions they select.
"""

from __future__ import annotations

import threading
import time

import attrs
import pytest
import torch

import vlmreg
from tests.train.test_packing import mixed_conversations
from vlmreg.config import parse_config
from vlmreg.data import ImageStore
from vlmreg.data.prompts import PromptEncoder
from vlmreg.data.store import ImageTokenError
from vlmreg.train.batching import MicroBatches, loss_tokens, make_microbatches, plan_microbatches
from vlmreg.train.samples import TrainingSample

COMPLETIONS = ["The answer is red.", "Two images: blue, then green", "ok", "Red again, and then some more words."]


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    loaded = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": "cpu"}})
    )
    store = ImageStore()
    encoder = PromptEncoder(loaded.processor, store, loaded.resolved.descriptor)
    tokenizer = loaded.processor.tokenizer
    conversations = mixed_conversations(store)
    samples, completions = [], []
    for k, (conversation, text) in enumerate(zip(conversations, COMPLETIONS, strict=True)):
        prompt = encoder.encode(conversation)
        completion = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(completion) > 1
        ids = prompt.input_ids + completion
        mask = [False] * len(prompt.input_ids) + [True] * len(completion)
        # one value per token
        logprobs = [0.0] * len(prompt.input_ids) + [-(k + 1) - j / 100 for j in range(len(completion))]
        samples.append(
            TrainingSample(ids, mask, logprobs, prompt.image_ids, prompt.image_spans, 0.5 + k, k, f"sample {k}")
        )
        completions.append(completion)
    return loaded, encoder, tokenizer, samples, completions


@pytest.mark.parametrize(("packed", "split"), [(True, False), (False, False), (True, True), (False, True)])
def test_loss_positions_target_the_completion_tokens_read_off_the_tokenizer(setup, packed, split):
    loaded, encoder, tokenizer, samples, completions = setup
    budget = max(len(s) for s in samples) if split else 4096
    batches = make_microbatches(
        samples, loaded.resolved, encoder, budget=budget, packed=packed, device=torch.device("cpu")
    )
    assert (len(batches) > 1) == split
    seen: dict[int, list[int]] = {}
    for mb in batches:
        owner = mb.sample_index[mb.loss_mask]
        targets = mb.targets[mb.loss_mask]
        logprobs = mb.rollout_logprobs[mb.loss_mask]
        advantages = mb.advantages[mb.loss_mask]
        assert torch.equal(mb.pick(mb.targets), targets) and mb.loss_tokens == int(mb.loss_mask.sum())
        assert torch.equal(owner.unique(), torch.tensor(sorted(mb.samples)))
        for i in owner.unique().tolist():
            got = targets[owner == i].tolist()
            seen[i] = got
            # a token is predicted from the one before it: the first completion token is the first target, so every
            # completion token is trained on, and nothing of the prompt
            assert got == completions[i], (i, tokenizer.decode(got), COMPLETIONS[i])
            assert tokenizer.decode(got) == COMPLETIONS[i]
            expected = [-(i + 1) - j / 100 for j in range(len(completions[i]))]
            assert torch.allclose(logprobs[owner == i], torch.tensor(expected))
            assert torch.all(advantages[owner == i] == 0.5 + i)
        # the flat selection and per-sequence numbering the update reads without a sync
        assert torch.equal(mb.selected, mb.loss_mask.flatten().nonzero().squeeze(1))
        assert mb.num_sequences == len(mb.samples)
        order = {s: n for n, s in enumerate(sorted(mb.samples))}
        assert mb.sequence.tolist() == [order[s] for s in owner.tolist()]
    assert sorted(seen) == list(range(len(samples)))
    assert loss_tokens(samples) == sum(len(c) for c in completions)


def test_padded_rows_hold_each_sample_from_the_left_with_a_mask(setup):
    loaded, encoder, tokenizer, samples, _ = setup
    (mb,) = make_microbatches(samples, loaded.resolved, encoder, budget=4096, packed=False, device=torch.device("cpu"))
    width = max(len(s) for s in samples)
    assert mb.inputs["input_ids"].shape == (len(samples), width)
    assert mb.tokens == sum(len(s) for s in samples)
    for r, s in enumerate(samples):
        assert mb.inputs["input_ids"][r, : len(s)].tolist() == s.input_ids
        assert mb.inputs["attention_mask"][r].tolist() == [1] * len(s) + [0] * (width - len(s))
        assert mb.sample_index[r].tolist() == [r] * len(s) + [-1] * (width - len(s))
        assert not mb.loss_mask[r, len(s) - 1 :].any()  # the last token predicts nothing


def test_packed_row_holds_the_samples_end_to_end_with_segment_bounds(setup):
    loaded, encoder, tokenizer, samples, _ = setup
    (mb,) = make_microbatches(samples, loaded.resolved, encoder, budget=4096, packed=True, device=torch.device("cpu"))
    lengths = [len(s) for s in samples]
    assert mb.inputs["input_ids"][0].tolist() == [t for s in samples for t in s.input_ids]
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    assert torch.equal(mb.inputs["cu_seq_lens_q"], bounds) and torch.equal(mb.inputs["cu_seq_lens_k"], bounds)
    assert mb.inputs["max_length_q"] == mb.inputs["max_length_k"] == max(lengths)
    assert mb.tokens == sum(lengths)
    for k, end in enumerate(bounds[1:].tolist()):
        assert not mb.loss_mask[0, end - 1]  # a segment's last token does not predict the next segment's first
        assert mb.sample_index[0, end - 1] == k


def test_plan_is_first_fit_decreasing():
    # 60+40, then 50+10; the smallest micro-batch first (built soonest)
    assert plan_microbatches([10, 60, 50, 40], 100, packed=True) == [[0, 2], [1, 3]]
    assert plan_microbatches([30, 30, 30], 90, packed=True) == [[0, 1, 2]]  # exactly full fits
    assert plan_microbatches([30, 30, 30], 89, packed=True) == [[2], [0, 1]]
    assert plan_microbatches([40, 20, 20], 80, packed=False) == [[2], [0, 1]]  # padded: rows x longest
    assert plan_microbatches([50, 50, 50, 50], 100, packed=True) == [[0, 1], [2, 3]]  # ties keep their order
    assert plan_microbatches([20, 20, 20, 20], 80, packed=False) == [[0, 1, 2, 3]]


def test_loss_tokens_counts_every_generated_token_but_a_first_one():
    """Counted without building micro-batches: a generated token at position 0 predicts nothing and is not counted."""

    def sample(mask):
        return TrainingSample(list(range(10, 10 + len(mask))), mask, [0.0] * len(mask), [], [], 1.0, 0, "x")

    assert loss_tokens([sample([False, True, True])]) == 2  # a one-token prompt
    assert loss_tokens([sample([True, True, False, True])]) == 2
    assert loss_tokens([sample([False, True]), sample([False, False, True, True])]) == 3
    assert loss_tokens([]) == 0


def test_pick_equals_boolean_indexing_for_per_token_and_per_vocabulary_values(setup):
    loaded, encoder, tokenizer, samples, _ = setup
    (mb,) = make_microbatches(samples, loaded.resolved, encoder, budget=4096, packed=False, device=torch.device("cpu"))
    values = torch.randn(*mb.loss_mask.shape, 3)
    assert torch.equal(mb.pick(values), values[mb.loss_mask])
    assert torch.equal(mb.pick(values[..., 0]), values[..., 0][mb.loss_mask])
    assert torch.equal(mb.selection, mb.selected)


def test_prefetched_micro_batches_equal_the_list_and_index_like_one(setup):
    loaded, encoder, tokenizer, samples, _ = setup
    budget = max(len(s) for s in samples)
    plain = make_microbatches(samples, loaded.resolved, encoder, budget=budget, packed=True, device=torch.device("cpu"))
    ahead = make_microbatches(
        samples, loaded.resolved, encoder, budget=budget, packed=True, device=torch.device("cpu"), prefetch=True
    )
    assert isinstance(plain, list) and len(ahead) == len(plain) > 2
    assert ahead[-1] is ahead[len(plain) - 1]  # built once, then kept
    assert [mb.samples for mb in ahead] == [mb.samples for mb in plain]
    assert [mb.samples for mb in ahead[1:3]] == [mb.samples for mb in plain[1:3]]
    for a, b in zip(ahead, plain, strict=True):
        assert torch.equal(a.targets, b.targets) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.inputs["input_ids"], b.inputs["input_ids"])
    for bad in (len(plain), -len(plain) - 1):
        with pytest.raises(IndexError):
            ahead[bad]


def test_a_micro_batch_without_its_flat_positions_picks_by_its_mask(setup):
    """``MicroBatch.selected`` is optional: without it, ``pick``, ``selection`` and ``loss_tokens`` read the mask."""
    loaded, encoder, tokenizer, samples, _ = setup
    (mb,) = make_microbatches(samples, loaded.resolved, encoder, budget=4096, packed=True, device=torch.device("cpu"))
    bare = attrs.evolve(mb, selected=None)
    values = torch.randn(*mb.loss_mask.shape)
    assert torch.equal(bare.pick(values), values[mb.loss_mask])
    assert bare.selection is bare.loss_mask and bare.loss_tokens == int(mb.loss_mask.sum())


def test_a_sample_whose_images_and_spans_disagree_is_refused_naming_it(setup):
    """Refused before any image is placed in a row, with the sample's name (so ``_placed``'s strict zip never sees
    one)."""
    loaded, encoder, tokenizer, samples, _ = setup
    with_images = next(s for s in samples if s.image_ids)
    broken = attrs.evolve(with_images, image_spans=with_images.image_spans[:-1])
    n, spans = len(broken.image_ids), len(broken.image_spans)
    with pytest.raises(ImageTokenError, match=f"{broken.example_id}: {n} image\\(s\\) but {spans} image span\\(s\\)"):
        make_microbatches([broken], loaded.resolved, encoder, budget=4096, packed=True, device=torch.device("cpu"))


def test_a_completion_token_sampled_with_logprob_zero_is_still_trained_on(setup):
    """The loss positions are the loss mask's, whatever the rollout logprobs hold (a token sampled with probability 1
    has logprob 0.0; the prompt's are 0.0 too)."""
    loaded, encoder, tokenizer, samples, completions = setup
    certain = [attrs.evolve(s, rollout_logprobs=[0.0] * len(s)) for s in samples]
    for packed in (True, False):
        (mb,) = make_microbatches(
            certain, loaded.resolved, encoder, budget=4096, packed=packed, device=torch.device("cpu")
        )
        assert torch.equal(mb.selected, mb.loss_mask.flatten().nonzero().squeeze(1))
        assert mb.pick(mb.targets).tolist() == [t for c in completions for t in c]
        assert mb.sequence.tolist() == [k for k, c in enumerate(completions) for _ in c]


def test_packed_segment_bounds_are_flash_attention_s_own_from_the_positions():
    """A family without a position provider (internvl): positions count 0..n-1 in each segment, as transformers numbers
    a sample run alone, and the packed row's ``cu_seq_lens`` and maximum lengths equal what transformers'
    ``prepare_fa_kwargs_from_position_ids`` derives from those positions (int32 bounds; the lengths as host ints, so the
    attention needs no device sync)."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids  # noqa: PLC0415

    from vlmreg.modeling.attention import PACKED_TOKENS  # noqa: PLC0415

    loaded = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "internvl"}, "trainer": {"device": "cpu"}})
    )
    assert loaded.resolved.descriptor.position_ids is None and loaded.resolved.descriptor.packing
    encoder = PromptEncoder(loaded.processor, ImageStore(), loaded.resolved.descriptor)
    samples = []
    for k, text in enumerate(["one", "a longer question with more words", "two words"]):
        prompt = encoder.encode([{"role": "user", "content": text}])
        ids = prompt.input_ids + [10 + k] * (k + 2)
        mask = [False] * len(prompt.input_ids) + [True] * (k + 2)
        samples.append(TrainingSample(ids, mask, [0.0] * len(ids), [], [], 1.0, k, f"sample {k}"))
    lengths = [len(s) for s in samples]
    cpu = torch.device("cpu")
    (packed,) = make_microbatches(samples, loaded.resolved, encoder, budget=4096, packed=True, device=cpu)
    assert packed.inputs["position_ids"].tolist() == [[p for n in lengths for p in range(n)]]
    (bounds, _), (longest, _) = prepare_fa_kwargs_from_position_ids(packed.inputs["position_ids"])
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert packed.inputs[key].dtype == bounds.dtype == torch.int32 and torch.equal(packed.inputs[key], bounds)
    for key in ("max_length_q", "max_length_k"):
        assert type(packed.inputs[key]) is int and packed.inputs[key] == int(longest)
    assert type(packed.inputs[PACKED_TOKENS]) is int and packed.inputs[PACKED_TOKENS] == sum(lengths)
    (padded,) = make_microbatches(samples, loaded.resolved, encoder, budget=4096, packed=False, device=cpu)
    for r, n in enumerate(lengths):
        assert padded.inputs["position_ids"][r, :n].tolist() == list(range(n))


def test_packed_and_padded_micro_batches_follow_their_own_plans(setup):
    """Packed rows fit the budget in tokens, padded ones in rows x longest: the same samples and budget group
    differently (the planner's cases are checked by hand above)."""
    loaded, encoder, tokenizer, samples, _ = setup
    lengths = [len(s) for s in samples]
    budget = sorted(lengths)[0] + sorted(lengths)[1]
    groups = {}
    for packed in (True, False):
        batches = make_microbatches(
            samples, loaded.resolved, encoder, budget=budget, packed=packed, device=torch.device("cpu")
        )
        groups[packed] = [list(mb.samples) for mb in batches]
        assert groups[packed] == plan_microbatches(lengths, budget, packed=packed)
    assert groups[True] != groups[False]


def test_prefetching_builds_the_first_micro_batch_at_once_and_then_the_one_after_the_one_asked_for():
    """Built on a background thread, in order: the first before any is asked for, then index + 1 on each access; the
    last is queued without the caller waiting for it."""
    built: list[int] = []
    release = threading.Event()

    def build(index: int) -> int:
        if index == 3:
            release.wait(10)
        built.append(index)
        return index

    batches = MicroBatches(4, build)
    for _ in range(200):  # asked for nothing yet: the first is being built
        if built:
            break
        time.sleep(0.01)
    assert built == [0]
    assert batches[0] == 0
    assert batches[1] == 1 and batches[2] == 2  # asking for index 2 queues the last one (3)
    time.sleep(0.05)
    assert built == [0, 1, 2]  # the last is held back, and asking for 2 did not wait for it
    release.set()
    assert batches[3] == 3 and built == [0, 1, 2, 3]
    with pytest.raises(IndexError, match="^4$"):
        batches[4]


def test_padded_positions_are_the_model_s_own_rope_index(setup):
    """A padded micro-batch's 3-D M-RoPE positions equal transformers' ``get_rope_index`` on the same batch (at the
    real tokens; padding is masked), after a text row counting each row's tokens."""
    loaded, encoder, tokenizer, samples, _ = setup
    (mb,) = make_microbatches(samples, loaded.resolved, encoder, budget=4096, packed=False, device=torch.device("cpu"))
    inputs = mb.inputs
    expected, _ = loaded.model.model.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
        attention_mask=inputs["attention_mask"],
    )
    real = inputs["attention_mask"].bool()
    positions = inputs["position_ids"]
    assert positions.shape == (4, *expected.shape[1:])  # the text positions first, then the three M-RoPE rows
    assert torch.equal(positions[1:][:, real], expected[:, real])
    for r, s in enumerate(samples):
        assert positions[0, r, : len(s)].tolist() == list(range(len(s)))
