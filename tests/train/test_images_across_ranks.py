"""Under FSDP2 a vision block gathers its weights when it runs: the ranks' i-th micro-batches must all carry images or
none. Two ranks in this process (torch's threaded process group, `threaded_ranks`), the tiny qwen3_vl sharded as the
trainer shards it. The reference for the check: the same micro-batches through FSDP2's own update fail in its
all-gather, so the error before any forward replaces a failure (a hang on NCCL), never a step that would have run."""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest

from tests.train.test_packing import setup_family
from tests.train.threaded_ranks import RankFailed, threaded_world
from vlmreg.resolution import resolve
from vlmreg.sdk.errors import VlmregError
from vlmreg.train.batch_update import _microbatches
from vlmreg.train.batching import make_microbatches
from vlmreg.train.distributed import Distributed, shard_model
from vlmreg.train.step import LossSettings, policy_update

OBJECTIVE = LossSettings("grpo", 0.2, 0.28, True, 2.0, 0.0, 1.0)


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any, list]:
    """The model, its encoder and four samples: one image, two images, text only, one image."""
    return setup_family("qwen3_vl")


def sharded(loaded: Any, ctx: Distributed) -> Any:
    resolved = resolve(copy.deepcopy(loaded.model), family=loaded.resolved.descriptor)
    shard_model(resolved, ctx)
    return resolved


def trainer_of(loaded: Any, encoder: Any, resolved: Any, ctx: Distributed) -> Any:
    config = types.SimpleNamespace(trainer=types.SimpleNamespace(max_tokens_per_microbatch=4096, packing=True))
    return types.SimpleNamespace(config=config, dist=ctx, resolved=resolved, encoder=encoder, loaded=loaded)


def deal(ctx: Distributed, samples: list, per_rank: list[list[int]]) -> list:
    return [samples[i] for i in per_rank[ctx.rank]]


@pytest.mark.parametrize(
    ("per_rank", "bad"),
    [
        ([[0], [2]], "micro-batch 0 of this step carries images on rank(s) [0] but none on rank(s) [1]"),
        ([[2], [1]], "micro-batch 0 of this step carries images on rank(s) [1] but none on rank(s) [0]"),
        ([[0], [3]], None),  # images on both
    ],
)
def test_ranks_whose_micro_batches_disagree_on_images_all_stop_with_one_message(tiny, per_rank, bad):
    loaded, encoder, samples = tiny

    def rank(ctx: Distributed, mesh: Any) -> str | None:
        trainer = trainer_of(loaded, encoder, sharded(loaded, ctx), ctx)
        try:
            _microbatches(trainer, deal(ctx, samples, per_rank))
        except VlmregError as error:
            return str(error)
        return None

    with threaded_world() as run:
        said = run(rank)
    assert said[0] == said[1]
    assert (said[0] is None) if bad is None else (said[0] is not None and said[0].startswith(bad)), said


def test_an_idle_repeat_counts_as_the_micro_batch_it_repeats(tiny):
    """Rank 1 has one micro-batch with images, rank 0 two (images, then text only): rank 1 repeats its last as the
    second, so the second runs the vision tower on rank 1 only."""
    loaded, encoder, samples = tiny

    def rank(ctx: Distributed, mesh: Any) -> str | None:
        trainer = trainer_of(loaded, encoder, sharded(loaded, ctx), ctx)
        trainer.config.trainer.max_tokens_per_microbatch = 40 if ctx.rank == 0 else 4096
        try:
            _microbatches(trainer, deal(ctx, samples, [[0, 2], [1]]))
        except VlmregError as error:
            return str(error)
        return None

    with threaded_world() as run:
        said = run(rank)
    assert said[0] == said[1] and said[0] is not None
    assert said[0].startswith("micro-batch 1 of this step carries images on rank(s) [1] but none on rank(s) [0]")


def test_without_the_check_fsdp2s_own_update_fails_on_such_micro_batches(tiny):
    loaded, encoder, samples = tiny

    def rank(ctx: Distributed, mesh: Any) -> None:
        resolved = sharded(loaded, ctx)
        mine = deal(ctx, samples, [[0], [2]])
        mbs = make_microbatches(mine, resolved, encoder, budget=4096, packed=True, device=loaded.device)
        policy_update(resolved, mbs, OBJECTIVE, num_samples=2, total_tokens=100, loss_scale=2.0)

    with threaded_world() as run, pytest.raises(RankFailed, match="size of tensor"):
        run(rank)
