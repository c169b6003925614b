"""Under FSDP2 a vision block gathers its weights when it runs, so the ranks' i-th micro-batches must all run the vision
tower or none. Where one rank's micro-batch carries images and another's none, the trainer gives the other a stand-in
image segment without loss (`vlmreg.train.vision_ranks`).

Two ranks in this process (torch's threaded process group, `threaded_ranks`), the tiny model sharded as the trainer
shards it, updating through the trainer's own `_microbatches` and `_optimizer_steps`. The reference: one process
without FSDP2 updating on all the samples together (`make_microbatches` + `policy_update`, no stand-in anywhere):
the sharded gradients, frozen tower and trained, and the step's metrics equal its own. Without the stand-ins FSDP2's
own update fails on such micro-batches (the last test), and before them the trainer stopped the step with an error.
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any

import attrs
import pytest
import torch
from PIL import Image

import vlmreg
from tests.train.test_packing import mixed_conversations
from tests.train.threaded_ranks import RankFailed, threaded_world
from vlmreg.config import parse_config
from vlmreg.data import ImageStore, image_part, text_part
from vlmreg.data.prompts import PromptEncoder
from vlmreg.data.video import DecodedVideo
from vlmreg.modeling.logprobs import selected_logprobs
from vlmreg.modeling.recompute import pixel_elements
from vlmreg.resolution import resolve
from vlmreg.sdk.registry import get_registry
from vlmreg.sdk.video import video_part
from vlmreg.train.batch_update import _microbatches, _optimizer_steps
from vlmreg.train.batching import loss_tokens, make_microbatches
from vlmreg.train.distributed import Distributed, full_tensor, shard_model
from vlmreg.train.samples import TrainingSample
from vlmreg.train.step import LossSettings, policy_update, summarise
from vlmreg.train.vision_ranks import media_of, stand_in_sample, stand_ins_needed

OBJECTIVE = LossSettings("grpo", 0.2, 0.28, True, 2.0, 0.0, 1.0)
#: a budget no two samples fit: one sample a micro-batch
ONE_EACH = 1


@pytest.fixture(scope="module")
def qwen3_vl() -> tuple[Any, Any, list]:
    return family_samples("qwen3_vl")


def family_samples(family: str) -> tuple[Any, Any, list]:
    """The model, its encoder and four samples (one image, two images, text only, one image; for a family that takes
    video two more: an image and a clip, a clip alone), with completions the
    tokenizer writes (a tiny vocabulary has no room for random ids), advantages of both signs and rollout logprobs of
    their own, so loss, TIS weights and mismatch_kl all have something to count."""
    torch.manual_seed(0)
    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": family}, "trainer": {"device": "cpu"}}))
    if loaded.resolved.descriptor.prepare_model:
        loaded.resolved.descriptor.prepare_model(loaded.model)
    encoder = PromptEncoder(loaded.processor, ImageStore(), loaded.resolved.descriptor)
    generator = torch.Generator().manual_seed(3)
    words = encoder.tokenizer("red green blue, the answer is plain", add_special_tokens=False)["input_ids"]
    samples = []
    conversations = mixed_conversations(encoder.store)
    if encoder.video_placeholder is not None:  # a family that takes video: an image and a clip, a clip alone
        frames = tuple(Image.new("RGB", (64, 64), c) for c in ("red", "red", "blue", "blue"))
        clip = video_part(encoder.store.add_video(DecodedVideo(frames, 2.0, 4, (0, 1, 2, 3))))
        image = image_part(encoder.store.add(Image.new("RGB", (64, 64), "green")))
        conversations += [
            [{"role": "user", "content": [image, clip, text_part("Which colours?")]}],
            [{"role": "user", "content": [clip, text_part("Which colours?")]}],
        ]
    for k, conversation in enumerate(conversations):
        prompt = encoder.encode(conversation)
        completion = (words * 4)[k : k + 6 + k]
        ids = prompt.input_ids + completion
        samples.append(
            TrainingSample(
                ids,
                [False] * len(prompt.input_ids) + [True] * len(completion),
                (-torch.rand(len(ids), generator=generator)).tolist(),
                prompt.image_ids,
                prompt.image_spans,
                (-1.0) ** k * (0.5 + k),
                k,
                f"sample {k}",
            )
        )
    return loaded, encoder, samples


def sharded(loaded: Any, ctx: Distributed, train_vision: bool) -> Any:
    model = copy.deepcopy(loaded.model)
    if train_vision:
        model.requires_grad_(True)
    resolved = resolve(model, family=loaded.resolved.descriptor)
    shard_model(resolved, ctx)
    return resolved


def trainer_of(loaded: Any, encoder: Any, resolved: Any, ctx: Distributed, budget: int) -> Any:
    config = types.SimpleNamespace(
        trainer=types.SimpleNamespace(
            max_tokens_per_microbatch=budget, packing=True, updates_per_batch=1, max_grad_norm=1e9
        )
    )
    trained = [p for p in resolved.model.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        config=config,
        dist=ctx,
        resolved=resolved,
        encoder=encoder,
        loaded=loaded,
        model=resolved.model,
        optimizer=torch.optim.SGD(trained, lr=0.0),  # a step that changes nothing: the gradients stay to compare
        objective=OBJECTIVE,
        reference=None,
        recompute=None,
    )


def one_process(loaded: Any, encoder: Any, samples: list, train_vision: bool) -> tuple[dict, dict]:
    """The reference: every sample in one process, no FSDP2, one micro-batch: its metrics and gradients."""
    model = copy.deepcopy(loaded.model)
    if train_vision:
        model.requires_grad_(True)
    resolved = resolve(model, family=loaded.resolved.descriptor)
    batches = make_microbatches(samples, resolved, encoder, budget=4096, packed=True, device=loaded.device)
    total = loss_tokens(samples)
    metrics = summarise(policy_update(resolved, batches, OBJECTIVE, num_samples=len(samples)), total)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    metrics["grad_norm"] = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])))
    blocks = {id(p) for block in resolved.vision_blocks for p in block.parameters()}
    vision = [p.grad for p in model.parameters() if id(p) in blocks and p.requires_grad]
    assert (len(vision) > 0) == train_vision and all(g.abs().sum() > 0 for g in vision)  # the tower as asked
    return metrics, grads


def two_ranks(loaded: Any, encoder: Any, samples: list, per_rank: list[list[int]], budgets: list[int], train: bool):
    """Each rank updates on its samples through the trainer's micro-batches; by rank: what its samples carry in each
    micro-batch (images, videos), the floating-point inputs (pixels) the built micro-batches carry, the real tokens,
    the metrics and the gradients."""

    def rank(ctx: Distributed, mesh: Any) -> dict[str, Any]:
        resolved = sharded(loaded, ctx, train)
        trainer = trainer_of(loaded, encoder, resolved, ctx, budgets[ctx.rank])
        mine = [samples[i] for i in per_rank[ctx.rank]]
        total_tokens, total_samples = (int(v) for v in ctx.sum([loss_tokens(mine), len(mine)]))
        batches, idle = _microbatches(trainer, mine)
        metrics = _optimizer_steps(trainer, batches, idle=idle, total_tokens=total_tokens, total_samples=total_samples)
        return {
            "planned": [media_of([mine[i] for i in mb.samples]) for mb in batches],
            "carried": [
                sorted(k for k, v in mb.inputs.items() if torch.is_tensor(v) and v.is_floating_point())
                for mb in batches
            ],
            "tokens": sum(mb.tokens for mb in batches[: len(batches) - idle]),
            "mine": sum(len(s) for s in mine),
            "metrics": metrics,
            "grads": {n: full_tensor(p.grad) for n, p in resolved.model.named_parameters() if p.requires_grad},
        }

    with threaded_world() as run:
        return run(rank)


CASES = {
    # rank 0 an image, rank 1 text only
    "image-or-text": ([[0], [2]], [4096, 4096]),
    # micro-batch 0 images on both, micro-batch 1 text on rank 0 only
    "second-differs": ([[0, 2], [1, 3]], [ONE_EACH, ONE_EACH]),
    # rank 1 has one text micro-batch: its idle repeat (text) meets rank 0's second image micro-batch
    "idle-repeat-text": ([[0, 1], [2]], [ONE_EACH, 4096]),
    # rank 0 has one image micro-batch: its idle repeat (images) meets rank 1's text micro-batch
    "idle-repeat-images": ([[1], [0, 2]], [4096, ONE_EACH]),
}
VIDEO_CASES = {
    # images on both, a clip on rank 0 only: the model runs its tower a second time there
    "clip-and-image-or-image": ([[4], [0]], [4096, 4096]),
    "clip-or-text": ([[5], [2]], [4096, 4096]),
    # each rank lacks the other's kind
    "clip-or-image": ([[5], [0]], [4096, 4096]),
}


def check_against_one_process(loaded, encoder, samples, per_rank, budgets, train) -> None:
    ranks = two_ranks(loaded, encoder, samples, per_rank, budgets, train)
    planned = [r["planned"] for r in ranks]
    assert any(
        a != b for a, b in zip(*(p + p[-1:] * (max(map(len, planned)) - len(p)) for p in planned), strict=True)
    ), planned  # the case is one the ranks disagree on
    assert ranks[0]["carried"] == ranks[1]["carried"], [r["carried"] for r in ranks]  # now they agree
    for r in ranks:  # a stand-in adds no real token
        assert r["tokens"] == r["mine"]
    expected_metrics, expected = one_process(loaded, encoder, [samples[i] for i in sorted(sum(per_rank, []))], train)
    for r in ranks:
        for name, value in expected_metrics.items():
            got = r["metrics"][name]
            assert abs(got - value) <= 1e-5 * max(abs(value), 1e-3), (name, got, value)
        # relative to each gradient's size, as tests/train/fsdp_gradients.py; a gradient that is zero in exact
        # arithmetic (a key projection's bias: softmax ignores a shift shared by all keys) is rounding noise of
        # about 1e-11, so the floor is a millionth of the whole gradient's norm
        floor = 1e-6 * expected_metrics["grad_norm"]
        for name, want in expected.items():
            error = float((r["grads"][name] - want).norm() / (want.norm() + floor))
            assert error < 5e-4, (name, error)


@pytest.mark.parametrize("train", [False, True], ids=["frozen-tower", "trained-tower"])
@pytest.mark.parametrize("case", list(CASES))
def test_ranks_that_disagree_on_images_update_as_one_process_does(qwen3_vl, case, train):
    loaded, encoder, samples = qwen3_vl
    per_rank, budgets = CASES[case]
    check_against_one_process(loaded, encoder, samples, per_rank, budgets, train)


@pytest.mark.parametrize("case", list(VIDEO_CASES))
def test_ranks_that_disagree_on_videos_update_as_one_process_does(qwen3_vl, case):
    loaded, encoder, samples = qwen3_vl
    per_rank, budgets = VIDEO_CASES[case]
    check_against_one_process(loaded, encoder, samples, per_rank, budgets, True)


@pytest.mark.parametrize("case", ["image-or-text", "second-differs"])
def test_a_fixed_size_family_with_padded_micro_batches_does_too(case):
    """gemma3: the processor resizes every image to one size, and padded micro-batches (the stand-in is a row)."""
    loaded, encoder, samples = family_samples("gemma3")
    per_rank, budgets = CASES[case]
    check_against_one_process(loaded, encoder, samples, per_rank, budgets, True)


def test_stand_ins_go_where_another_rank_has_images_and_idle_repeats_carry_their_last():
    i, v, iv, none = (True, False), (False, True), (True, True), (False, False)
    assert stand_ins_needed([[i], [none]], 1) == {0: i} and stand_ins_needed([[i], [none]], 0) == {}
    assert stand_ins_needed([[i, none], [i, i]], 0) == {1: i}
    assert stand_ins_needed([[none], [i, i]], 0) == {0: i, 1: i}  # the idle repeat too
    assert stand_ins_needed([[i], [i, none]], 1) == {1: i}  # rank 0's idle repeat carries images
    assert stand_ins_needed([[none, none], [none]], 0) == {}
    assert stand_ins_needed([[none], [i], [none, none]], 2) == {0: i, 1: i}  # three ranks, an idle repeat
    assert stand_ins_needed([[none], [none, i], [none, none]], 0) == {1: i}
    assert stand_ins_needed([[iv], [i]], 1) == {0: v} and stand_ins_needed([[v], [i]], 0) == {0: i}
    assert stand_ins_needed([[v], [i], [none]], 2) == {0: iv}


@pytest.mark.parametrize("family", get_registry().names())
def test_every_familys_stand_in_encodes_and_leaves_the_other_segments_as_they_were(family):
    """For each bundled family, the stand-in image (and, for a family that takes video, the stand-in clip, and both):
    encoded through the family's processor, it passes the image-token check and has no loss token; in a micro-batch
    beside a real sample it adds pixels and leaves that sample's logprobs what they are alone (within 1e-5). A stand-in
    with a loss token is refused."""
    torch.manual_seed(0)
    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": family}, "trainer": {"device": "cpu"}}))
    if loaded.resolved.descriptor.prepare_model:
        loaded.resolved.descriptor.prepare_model(loaded.model)
    loaded.model.eval()
    encoder = PromptEncoder(loaded.processor, ImageStore(), loaded.resolved.descriptor)
    image = encoder.store.add(Image.new("RGB", (64, 48), "red"))
    prompt = encoder.encode([{"role": "user", "content": [image_part(image), text_part("Colour?")]}])
    n = len(prompt.input_ids)
    answer = (encoder.tokenizer("red green blue", add_special_tokens=False)["input_ids"] * 3)[:3]
    sample = TrainingSample(
        [*prompt.input_ids, *answer],
        [False] * n + [True] * 3,
        [0.0] * (n + 3),
        prompt.image_ids,
        prompt.image_spans,
        1.0,
        0,
        "s",
    )
    build = functools.partial(
        make_microbatches, [sample], loaded.resolved, encoder, budget=4096, packed=True, device=loaded.device
    )
    (alone,) = build()
    with torch.no_grad():
        expected = selected_logprobs(loaded.resolved, alone.inputs, alone.targets, alone.selection)[0]
    kinds = [(True, False)] + ([(False, True), (True, True)] if encoder.video_placeholder is not None else [])
    for media in kinds:
        stand_in = stand_in_sample(encoder, media)
        assert not any(stand_in.loss_mask) and media_of([stand_in]) == media
        encoder.check(stand_in.input_ids, stand_in.image_ids, stand_in.image_spans, family)
        (together,) = build(stand_ins={0: stand_in})
        assert together.tokens == alone.tokens == len(sample) and together.samples == alone.samples == (0,)
        assert pixel_elements(together.inputs) > pixel_elements(alone.inputs)
        with torch.no_grad():
            got = selected_logprobs(loaded.resolved, together.inputs, together.targets, together.selection)[0]
        assert got.shape == expected.shape == (3,) and torch.allclose(got, expected, atol=1e-5, rtol=0), media
    with_loss = attrs.evolve(stand_in, loss_mask=[True] * len(stand_in))
    with pytest.raises(ValueError, match="no loss token"):
        build(stand_ins={0: with_loss})


def test_without_stand_ins_fsdp2s_own_update_fails_on_such_micro_batches(qwen3_vl):
    """Why the stand-ins: the same disagreement through FSDP2 without them fails in a vision block's all-gather."""
    loaded, encoder, samples = qwen3_vl

    def rank(ctx: Distributed, mesh: Any) -> None:
        resolved = sharded(loaded, ctx, False)
        mine = [samples[i] for i in [[0], [2]][ctx.rank]]
        mbs = make_microbatches(mine, resolved, encoder, budget=4096, packed=True, device=loaded.device)
        policy_update(resolved, mbs, OBJECTIVE, num_samples=2, total_tokens=100, loss_scale=2.0)

    with threaded_world() as run, pytest.raises(RankFailed, match="size of tensor"):
        run(rank)
