"""What each micro-batch position asks the loss for, checked against the tokenizer, not against vlmreg.

A completion is written as text and tokenized by the family's own tokenizer; the loss positions of every
micro-batch layout (packed, padded, split over several micro-batches) must target exactly those tokens, in order,
with the logprobs the rollout recorded for them and the sample's advantage. `tests/train/test_packing.py` checks that
the layouts agree with a plain forward; this checks which positions they select.
"""

from __future__ import annotations

import attrs
import pytest
import torch

import vlmreg
from tests.train.test_packing import mixed_conversations
from vlmreg.config import parse_config
from vlmreg.data import ImageStore
from vlmreg.data.prompts import PromptEncoder
from vlmreg.data.store import ImageTokenError
from vlmreg.train.batching import loss_tokens, make_microbatches, plan_microbatches
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
    assert plan_microbatches([10, 60, 50, 40], 100, packed=True) == [[1, 3], [0, 2]]  # 60+40, then 50+10
    assert plan_microbatches([30, 30, 30], 90, packed=True) == [[0, 1, 2]]  # exactly full fits
    assert plan_microbatches([30, 30, 30], 89, packed=True) == [[0, 1], [2]]
    assert plan_microbatches([40, 20, 20], 80, packed=False) == [[0, 1], [2]]  # padded: rows x longest
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
