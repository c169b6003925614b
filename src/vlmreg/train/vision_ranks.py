"""Under torchrun every rank runs the vision tower in the same micro-batches: a stand-in image where a rank has none.

FSDP2 (`vlmreg.train.distributed.shard_model`) shards each vision block on its own, so a block gathers its weights
only when it runs, i.e. only on ranks whose micro-batch carries images (and, with the tower trained, reduce-scatters
its gradients only in their backward). Each rank builds its micro-batches from its own samples, so for some i one
rank's i-th micro-batch may carry images and another's none: the collectives would no longer match (a size-mismatch
error on gloo, a hang on NCCL). Real runs mix both (text tasks, multi-turn environments).

So the ranks share, with the one collective that also counts their micro-batches, which of their micro-batches carry
images (an idle repeat carries what the rank's last micro-batch does), and a rank whose i-th has none while another
rank's has some adds one **stand-in** to it: a small image (`STAND_IN_SIZE` pixels square) alone in a user message,
encoded by the trainer's `PromptEncoder` through the family's own processor (a processor that takes fixed-size
images resizes it as it resizes any), placed as a segment of its own (packed: its own sequence, attended only by
itself; padded: its own row), with no loss on any of its tokens. It adds nothing to any count: no loss token, no
sequence for a per-sequence aggregation, no sample, no real token (`MicroBatch.tokens`), no metric. Since its image
embeddings feed the language model, the backward runs through the vision blocks on that rank too, so a trained
tower's reduce-scatters match as well; the gradient they receive from it is zero, since no loss reads its positions.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlmreg.data.prompts import PromptEncoder
from vlmreg.sdk.example import image_part
from vlmreg.train.samples import TrainingSample

__all__ = ["STAND_IN_SIZE", "padded_flags", "stand_in_sample", "stand_ins_needed"]

#: The stand-in image's side in pixels: small (a processor that resizes small images up to its minimum gives the
#: fewest tokens it can), yet not so small that a processor mistakes its width for a channel axis.
STAND_IN_SIZE = 32


def stand_ins_needed(every: Sequence[Sequence[bool]], rank: int) -> list[int]:
    """Which of ``rank``'s micro-batches get the stand-in, from every rank's flags (per micro-batch: does it carry
    images). A rank with fewer micro-batches than the busiest repeats its last (weight 0), and the repeats carry what
    it does. Every rank computes from the same flags, so the ranks agree: afterwards micro-batch i carries images on
    every rank or on none."""
    needed = max((len(flags) for flags in every), default=0)
    padded = [padded_flags(flags, needed) for flags in every]
    mine = padded[rank]
    return [i for i in range(len(mine)) if not mine[i] and any(flags[i] for flags in padded if flags)]


def padded_flags(flags: Sequence[bool], needed: int) -> list[bool]:
    """``flags`` with the idle repeats' (the last micro-batch's) up to ``needed``; empty for a rank with none."""
    return [*flags, *[flags[-1]] * (needed - len(flags))] if flags else []


def stand_in_sample(encoder: PromptEncoder) -> TrainingSample:
    """The stand-in: one small image alone in a user message, as ``encoder`` encodes it (its image in the encoder's
    store), every token without loss, advantage 0."""
    # deferred: start-up cost (loads PIL)
    from PIL import Image  # noqa: PLC0415

    image_id = encoder.store.add(Image.new("RGB", (STAND_IN_SIZE, STAND_IN_SIZE), "black"))
    prompt = encoder.encode(
        [{"role": "user", "content": [image_part(image_id)]}], add_generation_prompt=False, where="stand-in image"
    )
    n = len(prompt.input_ids)
    return TrainingSample(
        list(prompt.input_ids),
        [False] * n,
        [0.0] * n,
        list(prompt.image_ids),
        list(prompt.image_spans),
        0.0,
        -1,
        "stand-in image",
    )
